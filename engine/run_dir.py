"""The run directory: ``<expdir>/<config>/<world size>/<run_num>/``, holding ``out.log``,
``config.yaml``, ``tensorboard/``, ``checkpoints/`` and, while a process trains it, its lock
``.run.lock`` (runs started at once each get their own: docs/preemption.md, "Many runs at
once"). A start that fails in set-up leaves no run behind (``discard_unstarted_run``).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from datapipe.make_data import HOST, file_lock
from engine import checkpoint
from engine.runtime import Runtime
from observe.logging_utils import setup_logging
from settings.parse import dump, load_yaml_configs
from settings.errors import ConfigError, on_every_rank

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger("train")


COMPUTE_ONLY = "-synthetic"  # runs on generated batches sit apart from the config's real runs


def open_run_dir(cfg: Config, rt: Runtime) -> str:
    """The run's directory (``resolve_run_num``), locked for this process, its out.log opened."""
    why = resolve_run_num(cfg, rt)
    run_dir = run_dir_for(cfg, rt.world_size)
    setup_logging(rt.rank, os.path.join(run_dir, "out.log"))
    if why:
        log.info(f"Run {cfg.run_num} ({why})")
    return run_dir


def write_config(cfg: Config, run_dir: str, derived: dict, resumed: bool):
    """The resolved config as ``<run_dir>/config.yaml`` (a resumed run keeps its own)."""
    path = os.path.join(run_dir, "config.yaml")
    if not resumed or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(dump(cfg, derived))
    log.info(f"Resolved config: {path} (all settings; python train.py --help lists them)")


def run_dir_for(cfg: Config, world_size: int) -> str:
    """``<expdir>/<config>/<ranks>/<run>``; a run on generated batches (compute-only timing) under
    ``<config>-synthetic``, where neither TensorBoard nor ``--resume`` takes it for the config's."""
    name = cfg.name + (COMPUTE_ONLY if cfg.data_is_generated else "")
    return os.path.join(cfg.expdir, name, str(world_size), str(cfg.run_num))


AUTO = "auto"


def resolve_run_num(cfg: Config, rt: Runtime) -> str:
    """Rank 0 claims and locks this run's directory (``auto``: docs/checkpoints.md, "Run numbers"),
    whose name replaces ``run_num: auto`` in ``cfg`` on every rank; how it was chosen, for the log
    ("" for a named run). A run directory another live process trains is refused."""
    choice = [None]
    if rt.is_main:
        try:
            choice = [_claim_run(cfg, rt.world_size)]
        except ConfigError as e:
            choice = [on_every_rank(e)]
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], ConfigError):
        raise choice[0]
    cfg.run_num, why = choice[0]
    return why


def _model_of(run_dir: str) -> str | None:  # as its config.yaml names it (None: unreadable)
    try:
        (settings,) = load_yaml_configs(os.path.join(run_dir, "config.yaml")).values()
        return settings.get("model")
    except ValueError:  # (ConfigError included: missing, unreadable, not a config)
        return None


def _claim_run(cfg: Config, world_size: int) -> tuple[str, str]:  # (run name, how chosen)
    _made.forget()
    if cfg.run_num != AUTO:
        run_dir = run_dir_for(cfg, world_size)
        existed = os.path.isdir(run_dir)
        _make_dirs(cfg, run_dir)
        note = lock_run_dir(run_dir)
        if not existed:
            _made.run = os.path.abspath(run_dir)
        elif not os.path.exists(os.path.join(run_dir, "out.log")):
            _made.log = os.path.abspath(os.path.join(run_dir, "out.log"))
        return cfg.run_num, f"--run_num {cfg.run_num}: {note}" if note else ""
    parent = os.path.dirname(run_dir_for(cfg, world_size))
    runs = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    if cfg.resume and not cfg.resume_from:
        newest = {}
        for run in runs:
            found = checkpoint.list_checkpoints(os.path.join(parent, run, "checkpoints"))
            # (under an --expdir both models' runs of a config name share the parent)
            if found and _model_of(os.path.join(parent, run)) in (None, cfg.model):
                newest[run] = os.path.getmtime(found[0])
        if newest:
            run = max(newest, key=newest.get)
            note = lock_run_dir(os.path.join(parent, run))
            return run, ("--run_num auto with --resume: the run with the newest checkpoint"
                         + (f"; {note}" if note else ""))
        if cfg.resume is True:
            raise ConfigError(f"--resume: no run under {parent} holds a checkpoint: check "
                              f"--config, --expdir and the number of ranks ({world_size}), or "
                              f"use --resume_from PATH")
    numbers = [int(r) for r in runs if r.isdigit()]
    _make_dirs(cfg, parent)
    number = max(numbers) + 1 if numbers else 0
    while True:  # the listing only says where to start: creating the directory decides
        run_dir = os.path.join(parent, str(number))
        try:
            os.mkdir(run_dir)
            note = lock_run_dir(run_dir)
        except (FileExistsError, RunInUse):  # (RunInUse: a --run_num <number> run locked it first)
            number += 1
            continue
        except OSError as e:
            raise _cannot_create(cfg, run_dir, e) from None
        _made.dirs.append(os.path.abspath(run_dir))
        _made.run = os.path.abspath(run_dir)
        return str(number), (f"--run_num auto: the next free number under {parent}"
                             + (f"; {note}" if note else ""))


def _make_dirs(cfg: Config, path: str):  # os.makedirs, noting the directories it creates
    missing, probe = [], os.path.abspath(path)
    while not os.path.exists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise _cannot_create(cfg, path, e) from None
    _made.dirs.extend(reversed(missing))


class _Made:
    """What this process created for the run it is starting: the directories (outermost first),
    the run directory, the out.log it writes into an existing run without one."""

    def forget(self):
        self.dirs, self.run, self.log = [], None, None


_made = _Made()
_made.forget()


def discard_unstarted_run():
    """After a start that failed in set-up: remove what this process created (``_Made``)."""
    root, made = logging.getLogger(), [p for p in (_made.run, _made.log) if p]
    for h in list(root.handlers):  # out.log: closed before it or its directory goes
        if isinstance(h, logging.FileHandler) and any(
                h.baseFilename == p or h.baseFilename.startswith(p + os.sep) for p in made):
            root.removeHandler(h)
            h.close()
    if _made.log:
        with contextlib.suppress(OSError):
            os.remove(_made.log)
    if _made.run:
        shutil.rmtree(_made.run, ignore_errors=True)
    for path in reversed(_made.dirs):
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only when empty: another run may have come meanwhile
    _made.forget()


def _cannot_create(cfg: Config, path: str, e: OSError) -> ConfigError:
    return ConfigError(f"expdir={cfg.expdir}: cannot create the run directory {path} "
                       f"({e.strerror}): choose a directory you can write to")


# ----------------------------------------------------------------------------- the run's lock

LOCK_NAME = ".run.lock"
_held: set[str] = set()  # the lock files this process took (a forked child inherits, not holds)


class RunInUse(ConfigError):
    """Another process holds the run directory's lock."""


def _is_mine(record: dict | None) -> bool:
    return bool(record) and record.get("host") == HOST and record.get("pid") == os.getpid()


def lock_run_dir(run_dir: str) -> str:
    """Take ``run_dir``'s lock for this process (which keeps one it holds). Returns a note for
    the log when it took over the lock of a process that no longer runs, else "". RunInUse when
    a running process of this host holds it, or one of another host (which may run)."""
    path = os.path.join(run_dir, LOCK_NAME)
    note = ""
    try:
        for _ in range(100):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                record = _read_lock(path)
                if record is None:
                    continue  # released meanwhile: try again
                if _is_mine(record):  # (a second Trainer in one process)
                    _held.add(path)
                    return note
                earlier = _earlier_attempt_of_this_job(record)
                if not earlier and (record.get("host") != HOST
                                    or not isinstance(record.get("pid"), int)):
                    who = (f"{_holder(record)} holds it (lock {path}); whether it still runs "
                           f"cannot be told from {HOST}" if record
                           else f"the lock file {path} names no process")
                    raise RunInUse(f"run directory {run_dir} is locked: {who}: if no run of it is "
                                   f"going on (its process was killed, or its node lost), remove "
                                   f"{path} and start again; else wait for that run to end, or "
                                   f"start another run (another --run_num)") from None
                if not earlier and _alive(record["pid"], record.get("start")):
                    raise RunInUse(f"run directory {run_dir} is in use: {_holder(record)} "
                                   f"trains it (lock {path}); a run directory is trained by one "
                                   f"process at a time: wait for that run to end (or stop it), "
                                   f"or start another run (another --run_num; auto picks a free "
                                   f"one)") from None
                if _take_over(path, record):
                    note = (f"took over the lock of {_holder(record)}, "
                            + ("an earlier attempt of this Slurm job" if earlier
                               else "which no longer runs"))
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(_lock_record()) + "\n")
            _held.add(path)
            return note
    except OSError as e:
        raise ConfigError(f"cannot take the lock {path} ({e.strerror}): choose an --expdir you "
                          f"can write to") from None
    raise ConfigError(f"cannot take the lock {path}: it keeps changing hands; start the run again")


def release_run_locks():
    """Remove the run locks this process (not a forked child) holds, however its run ends."""
    for path in list(_held):
        _held.discard(path)
        if _is_mine(_read_lock(path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


atexit.register(release_run_locks)


def _lock_record() -> dict:
    pid = os.getpid()
    return {"host": HOST, "pid": pid, "start": _start_time(pid),
            "since": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:300],
            **_slurm_attempt()}


def _slurm_attempt() -> dict:  # the Slurm job and how often it was requeued
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "")
    if not job:
        return {}
    return {"slurm_job": job, "slurm_restart": int(restarts) if restarts.isdigit() else 0}


def _earlier_attempt_of_this_job(record: dict) -> bool:
    """The lock is an earlier attempt's of this Slurm job, which has ended (one at a time)."""
    mine = _slurm_attempt()
    theirs = record.get("slurm_restart")
    return bool(mine) and record.get("slurm_job") == mine["slurm_job"] and \
        isinstance(theirs, int) and theirs < mine["slurm_restart"]


def _holder(record: dict) -> str:
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    return (f"process {record.get('pid')} on {record.get('host')} (since {record.get('since')}"
            f"{job}: {record.get('command')})")


def _read_lock(path: str) -> dict | None:
    """The lock's record; None without a lock; {} when it names no process (after a second's
    wait for the write: its holder died between creating and writing it)."""
    for _ in range(20):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        with contextlib.suppress(ValueError):  # (partly written)
            record = json.loads(text)
            if isinstance(record, dict):
                return record
        time.sleep(0.05)
    return {}


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command (the state first, the start time 20th: it
    tells a process from a later one with its PID); None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    stat = _proc_stat(pid)
    return stat[19] if stat else None


def _alive(pid: int, start: str | None) -> bool:  # process pid of this host, started at start
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: it exists
    return stat[0] not in ("Z", "X") and start in (None, stat[19])  # Z, X: exited, not reaped


def _take_over(path: str, stale: dict) -> bool:
    """Remove the lock ``stale`` of a process that no longer runs, if it still is the lock (one
    taker of this host at a time, ``flock``: the second finds the first's lock instead)."""
    with file_lock(path + ".takeover"):
        if _read_lock(path) != stale:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
