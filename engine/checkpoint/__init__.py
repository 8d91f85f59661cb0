"""Checkpoints: the one package that uses torch's distributed checkpoint (DCP). Two forms, each
loading into any run (any number of ranks, DDP, FSDP or tp/cp; docs/checkpoints.md):
``ckpt_<step>.pt``, one file holding the whole state in the serial layout, written by rank 0;
``ckpt_<step>.dcp/``, an FSDP run's DCP directory (each rank its shards, rank 0 the metadata and
``train_state.pt``: the rest of the state), which ``python -m engine.checkpoint_convert`` turns
into a ``.pt`` file.

``files``: the forms on disk (atomic writes, the newest K kept, checked loads); ``state``: what
a checkpoint holds and the settings a resume may change; ``checkpointer``: the ``Checkpointer``
the training loop talks to (which checkpoint to resume, load, save).
"""
from engine.checkpoint.files import (REQUIRED, TENSORS, is_sharded, list_checkpoints, load_file,
                                     load_latest, path_for, read_tensors, save, save_sharded,
                                     state_nbytes, weights, written_for)
from engine.checkpoint.checkpointer import Checkpointer, RunFinished

__all__ = ["REQUIRED", "TENSORS", "is_sharded", "list_checkpoints", "load_file", "load_latest",
           "path_for", "read_tensors", "save", "save_sharded", "state_nbytes", "weights",
           "written_for", "Checkpointer", "RunFinished"]
