"""Checkpoints: the one package that uses torch's distributed checkpoint (DCP). Two forms, each
loading into any run (docs/checkpoints.md): ``ckpt_<step>.pt``, the whole state in the serial
layout, written by rank 0; ``ckpt_<step>.dcp/``, an FSDP run's DCP directory (each rank its
shards, rank 0 the metadata and ``train_state.pt``: the rest), which ``python -m
engine.checkpoint_convert`` turns into a ``.pt`` file. ``files``: the forms on disk; ``state``:
what a checkpoint holds; ``checkpointer``: what the training loop talks to.
"""
from engine.checkpoint.files import (  # noqa: F401 (the package's names)
    REQUIRED, TENSORS, is_sharded, list_checkpoints, load_file, load_latest, path_for, read_tensors,
    save, save_sharded, state_nbytes, weights, written_for)
from engine.checkpoint.checkpointer import Checkpointer, RunFinished  # noqa: F401
