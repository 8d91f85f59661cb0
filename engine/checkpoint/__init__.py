"""Checkpoints (docs/checkpoints.md), the one package that uses torch's distributed checkpoint:
``files``, the two forms on disk; ``state``, what a checkpoint holds; ``checkpointer``, what the
training loop talks to."""
from engine.checkpoint.files import (  # noqa: F401 (the package's names)
    REQUIRED, TENSORS, is_sharded, list_checkpoints, load_file, load_latest, path_for, read_tensors,
    save, state_nbytes, weights, written_for)
from engine.checkpoint.checkpointer import Checkpointer, RunFinished  # noqa: F401
