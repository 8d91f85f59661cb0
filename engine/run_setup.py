"""The checkpoint a run resumes from (``--resume``, ``--resume_from``): chosen once, on rank 0,
for every rank."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from engine import checkpoint
from engine.runtime import Runtime
from settings.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config


def find_resume_checkpoint(cfg: Config, run_dir: str, rt: Runtime):
    """``(state, path)`` of the checkpoint to continue from (``--resume``, ``--resume_from``), or
    None for a fresh run: one choice for all ranks. Rank 0 puts right what interrupted writes
    left in the run's checkpoints (``checkpoint.clean_leftovers``) and chooses; the others load
    exactly the checkpoint it chose, so that a rank with another view of the directory (a stale
    listing, a read error) never resumes from another step. A choice that does not load on some
    rank ends every rank with one line naming that rank."""
    choice = None  # (state, path), None for a fresh run, or the ConfigError every rank raises
    if rt.is_main:
        try:
            choice = _choose_checkpoint(cfg, run_dir, rt.world_size)
        except ConfigError as e:
            choice = e
    if not rt.distributed:
        if isinstance(choice, ConfigError):
            raise choice
        return choice
    sent = [choice[1] if isinstance(choice, tuple) else choice]
    # Rank 0's choice to every rank: the path, None for a fresh run, or the error all raise.
    dist.broadcast_object_list(sent, src=0, group=rt.host_group)
    if isinstance(sent[0], ConfigError):
        raise sent[0]
    if sent[0] is None:
        return None
    path = sent[0]
    if not rt.is_main:
        choice = checkpoint.load_file(path)
    loaded = [None] * rt.world_size
    # Whether the chosen checkpoint loaded on every rank: all go on with it, or all raise.
    dist.all_gather_object(loaded, choice[0] is not None, group=rt.host_group)
    if not all(loaded):
        rank = loaded.index(False)
        raise ConfigError(f"rank {rank} cannot load {path}, the checkpoint rank 0 chose to resume "
                          f"from (rank {rank}'s warning line says why): every rank must see the "
                          f"same files; check the file system they share, or move that "
                          f"checkpoint aside to resume from the one before")
    return choice


def _choose_checkpoint(cfg: Config, run_dir: str, world_size: int):
    """Rank 0's part of ``find_resume_checkpoint``. Refuses to start a fresh run over one that
    holds checkpoints. ``--resume auto`` (a requeued job) continues this run directory when it
    holds checkpoints, even one first started with ``--resume_from``, and otherwise starts as
    without it."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    checkpoint.clean_leftovers(ckpt_dir)
    existing = checkpoint.list_checkpoints(ckpt_dir)
    if cfg.resume == "auto" and existing:
        return _newest(ckpt_dir)
    if cfg.resume_from:
        if existing:
            raise ConfigError(f"--resume_from: {run_dir} already holds checkpoints: use --resume "
                              f"to continue it, or choose another --run_num")
        src = cfg.resume_from
        if os.path.isdir(os.path.join(src, "checkpoints")):
            src = os.path.join(src, "checkpoints")
        if os.path.isfile(src) or checkpoint.is_sharded(src):
            state, path = checkpoint.load_file(src)
        elif os.path.isdir(src):
            state, path = checkpoint.load_latest(src)
        else:
            raise ConfigError(f"--resume_from {src}: no such file or directory")
        if state is None:
            raise ConfigError(f"--resume_from {src}: no checkpoint there loads")
        return state, path
    if cfg.resume is not True:  # false, or auto with nothing to continue
        if existing:
            raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume to continue "
                              f"that run, or choose another --run_num")
        return None
    if not existing:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}: check --config, --run_num, "
                          f"--expdir and the number of ranks ({world_size}), or use "
                          f"--resume_from PATH")
    return _newest(ckpt_dir)


def _newest(ckpt_dir: str):
    state, path = checkpoint.load_latest(ckpt_dir)
    if state is None:
        raise ConfigError(f"--resume: none of the checkpoints in {ckpt_dir} loads (each is "
                          f"damaged or cut short; the log above names why): resume from a copy "
                          f"you kept with --resume_from PATH, or start a new run without "
                          f"--resume")
    return state, path
