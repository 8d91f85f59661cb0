"""Checkpoints: the one package that uses torch's distributed checkpoint (DCP).

Two forms, each loading into any run (any number of ranks, DDP, FSDP or tp/cp):

- ``ckpt_<step>.pt``: one file holding the whole state in the serial layout (parameters and
  Adam state keyed by parameter name), written by rank 0: every run but FSDP writes these.
- ``ckpt_<step>.dcp/``: a directory in DCP's format, written by an FSDP run: each rank writes
  its own shards of the parameters and the Adam state (no rank gathers the whole model), rank 0
  the metadata and ``train_state.pt`` (the rest: step, epoch, schedule, RNG streams, config).
  DCP reads the shards onto another number of ranks; a run without FSDP reads the whole
  tensors. ``python -m engine.checkpoint_convert`` turns one into a ``.pt`` file.

``files``: the forms on disk (atomic writes, the newest K kept, checked loads); ``state``: what
a checkpoint holds and the settings a resume may change; ``checkpointer``: the ``Checkpointer``
the training loop talks to (which checkpoint to resume, load, save).
"""
from engine.checkpoint.files import (REQUIRED, TENSORS, CheckpointException, convert,
                                     is_sharded, list_checkpoints, load_file, load_latest,
                                     path_for, read_pt, read_tensors, save, save_sharded,
                                     state_nbytes, unreadable, weights, written_for)
from engine.checkpoint.state import TrainState, setting_changes
from engine.checkpoint.checkpointer import Checkpointer

__all__ = ["REQUIRED", "TENSORS", "CheckpointException", "convert", "is_sharded",
           "list_checkpoints", "load_file", "load_latest", "path_for", "read_pt", "read_tensors",
           "save", "save_sharded", "state_nbytes", "unreadable", "weights", "written_for",
           "TrainState", "setting_changes", "Checkpointer"]
