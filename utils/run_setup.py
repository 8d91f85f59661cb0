"""Preparing a run before its first step: the run directory, the checkpoint to resume from, the
data (synthesised for the quickstarts), the resolved config beside the run, and the header lines
of its log.

A run directory is ``<expdir>/<config>/<world size>/<run_num>/`` and holds ``out.log``,
``config.yaml``, ``tensorboard/`` and ``checkpoints/``.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import torch.distributed as dist

from utils import checkpoint
from utils.config import Config, dump
from utils.data_loader import check_synthesis_target, has_data, synthesize
from utils.errors import ConfigError
from utils.runtime import Runtime

log = logging.getLogger(__name__)


def run_dir_for(cfg: Config, world_size: int) -> str:
    return os.path.join(cfg.expdir, cfg.name, str(world_size), str(cfg.run_num))


AUTO = "auto"


def resolve_run_num(cfg: Config, rt: Runtime) -> str:
    """Replace ``run_num: auto`` by a run's name (in ``cfg``), the same on every rank (rank 0
    looks, the others are told); returns how it was chosen, for the log ("" when given).

    - a fresh run (also ``--resume_from``): the next free number, one above the highest number
      among the runs of this config and rank count (0 for the first);
    - ``--resume``: the run that wrote the newest checkpoint;
    - ``--resume auto``: that run when there is one, else the next free number.
    ``submit_pm.sh`` names batch jobs ``job<id>`` instead, so that a requeued job resumes its own
    run and never another job's."""
    if cfg.run_num != AUTO:
        return ""
    choice = [None]
    if rt.is_main:
        try:
            choice = [_choose_run_num(cfg, rt.world_size)]
        except ConfigError as e:
            choice = [e]  # every rank raises it
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], ConfigError):
        raise choice[0]
    cfg.run_num, why = choice[0]
    return why


def _choose_run_num(cfg: Config, world_size: int) -> tuple[str, str]:
    parent = os.path.dirname(run_dir_for(cfg, world_size))
    runs = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    if cfg.resume and not cfg.resume_from:
        newest = {}
        for run in runs:
            found = checkpoint.list_checkpoints(os.path.join(parent, run, "checkpoints"))
            if found:
                newest[run] = os.path.getmtime(found[0])
        if newest:
            run = max(newest, key=newest.get)
            return run, "--run_num auto with --resume: the run with the newest checkpoint"
        if cfg.resume is True:
            raise ConfigError(f"--resume: no run under {parent} holds a checkpoint: check "
                              f"--config, --expdir and the number of ranks ({world_size}), or "
                              f"use --resume_from PATH")
    numbers = [int(r) for r in runs if r.isdigit()]
    run = str(max(numbers) + 1 if numbers else 0)
    return run, f"--run_num auto: the next free number under {parent}"


def find_resume_checkpoint(cfg: Config, run_dir: str, world_size: int):
    """``(state, path)`` of the checkpoint to continue from (``--resume``, ``--resume_from``), or
    None for a fresh run. Refuses to start a fresh run over one that holds checkpoints.
    ``--resume auto`` (a requeued job) continues this run directory when it holds checkpoints,
    even one first started with ``--resume_from``, and otherwise starts as without it."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
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
        if os.path.isdir(src):
            state, path = checkpoint.load_latest(src)
        elif os.path.isfile(src):
            state, path = checkpoint.load_file(src)
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
        raise ConfigError(f"--resume: none of the checkpoints in {ckpt_dir} loads")
    return state, path


# How long the other ranks wait for rank 0 to write synthetic data: far beyond any synthesis, so
# that only a dead rank 0 (its connection closes, and the wait fails at once) ends the wait.
SYNTHESIS_WAIT = datetime.timedelta(hours=24)


def ensure_data(cfg: Config, rt: Runtime):
    """Synthesise small data under data_root when the config asks for it and none is there (not
    for generated batches, which need no data)."""
    if not cfg.synthesize_if_missing or cfg.data_is_generated:
        return
    # Every rank checks that synthesis would not write over a user's files (so all stop alike);
    # rank 0 alone writes, and decides for everyone whether it does.
    missing = not has_data(cfg)
    if missing:
        check_synthesis_target(cfg)
    if rt.distributed:
        decision = [missing]
        dist.broadcast_object_list(decision, src=0)  # rank 0's view: it writes when it sees none
        missing = decision[0]
    if not missing:
        return
    # The other ranks wait until the whole set is written (none may read a training file whose
    # validation file is still to come), in a gloo group of their own: full-size synthesis can
    # outlast the default group's dist_timeout_s, and NCCL's watchdog would end the run.
    waiting = dist.new_group(backend="gloo", timeout=SYNTHESIS_WAIT) if rt.distributed else None
    if rt.is_main:
        others = f"; the other {rt.world_size - 1} rank(s) wait for it" if rt.distributed else ""
        log.info(f"No data under {cfg.data_root}: generating synthetic {cfg.model} data there "
                 f"(synthesize_if_missing is set for this config){others}")
        t0 = time.time()
        synthesize(cfg)
        log.info(f"Synthetic data written in {time.time() - t0:.1f} s")
    if waiting is not None:
        dist.barrier(group=waiting)
        dist.destroy_process_group(waiting)


def write_config(cfg: Config, run_dir: str, derived: dict, resumed: bool):
    """The resolved config, readable back with --yaml_config, as ``<run_dir>/config.yaml``
    (a resumed run keeps the file of the run it continues)."""
    path = os.path.join(run_dir, "config.yaml")
    log.info("Resolved config:\n" + dump(cfg, derived))
    if not resumed or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(dump(cfg, derived))


def log_run_header(model, rt: Runtime, loaders, total_steps: int, layout_summary: str | None):
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Device {rt.device}, {rt.world_size} rank(s), {rt.dp_size} data-parallel; model "
             f"{type(model).__name__} with {n_params / 1e6:.2f} M parameters"
             + (" on this rank" if rt.groups is not None else ""))
    if rt.groups is not None:
        log.info("Model-parallel layout: " + rt.groups.describe())
        log.info(layout_summary)
    log.info(f"{loaders.n_train} training samples, {loaders.n_valid} validation samples; "
             f"{loaders.steps_per_epoch} steps per epoch of {rt.global_batch} samples "
             f"({rt.local_batch} per rank); {total_steps} steps in all")
