"""Preparing a run before its first step: the run directory (claimed, and locked while a process
trains it), the checkpoint to resume from, the data (synthesised for the quickstarts, once for
all the runs that need it), the resolved config beside the run, and the header lines of its log.

A run directory is ``<expdir>/<config>/<world size>/<run_num>/`` and holds ``out.log``,
``config.yaml``, ``tensorboard/`` and ``checkpoints/`` (and ``.run.lock`` while a process trains
it).

Many runs may start at once into one experiment directory (a job array, a sweep):

- a run number is taken by creating its directory (``os.mkdir`` succeeds for exactly one
  process), the next number when it exists;
- a run directory is trained by one process at a time: ``.run.lock``, created with
  ``O_CREAT | O_EXCL``, names the host and process that hold it; it is removed when the run ends
  (finished, failed or stopped) and taken over when its process no longer runs on this host;
- synthetic data is made by one run while the others wait (``flock`` on ``<data_root>.lock``), in
  a staging directory beside data_root that is renamed into place once complete, so a data_root
  is either absent or whole.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from datapipe import synthetic
from datapipe.data_loader import check_synthesis_target, has_data, missing_data, synthesize
from engine import checkpoint
from engine.runtime import Runtime
from settings.parse import dump, load_yaml_configs
from settings.errors import ConfigError, DataError, UserError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)


COMPUTE_ONLY = "-synthetic"  # runs on generated batches sit apart from the config's real runs


def run_dir_for(cfg: Config, world_size: int) -> str:
    """``<expdir>/<config>/<ranks>/<run>``; a run on generated batches (``data_loader_config
    synthetic``: compute-only timing, its losses those of one repeated batch) under
    ``<config>-synthetic``, so that neither TensorBoard's run list nor a bare ``--resume`` takes
    it for a run of the config."""
    name = cfg.name + (COMPUTE_ONLY if cfg.data_is_generated else "")
    return os.path.join(cfg.expdir, name, str(world_size), str(cfg.run_num))


AUTO = "auto"


def resolve_run_num(cfg: Config, rt: Runtime) -> str:
    """Claim this run's directory and lock it for this process, on rank 0; replace ``run_num:
    auto`` by the run's name (in ``cfg``), the same on every rank (the others are told). Returns
    how the run was chosen, for the log ("" for a named run, unless a stale lock was taken over).

    - a fresh run (also ``--resume_from``): the next free number, from one above the highest
      number among the runs of this config and rank count (0 for the first): the first number
      whose directory this process creates (``os.mkdir``: one process wins each number);
    - ``--resume``: the run that wrote the newest checkpoint;
    - ``--resume auto``: that run when there is one, else the next free number.
    A run directory that another live process trains is refused (ConfigError naming it), for a
    named run and a resumed one alike. ``submit_pm.sh`` names batch jobs ``job<id>`` instead, so
    that a requeued job resumes its own run and never another job's."""
    choice = [None]
    if rt.is_main:
        try:
            choice = [_claim_run(cfg, rt.world_size)]
        except ConfigError as e:
            choice = [e]  # every rank raises it
    if rt.distributed:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], ConfigError):
        raise choice[0]
    cfg.run_num, why = choice[0]
    return why


def _model_of(run_dir: str) -> str | None:
    """The model family a run directory's config.yaml names; None when it cannot be read."""
    try:
        (settings,) = load_yaml_configs(os.path.join(run_dir, "config.yaml")).values()
        return settings.get("model")
    except ValueError:  # (ConfigError included: missing, unreadable, not a config)
        return None


def _claim_run(cfg: Config, world_size: int) -> tuple[str, str]:
    """(run name, how it was chosen) of the run directory this process now holds the lock of."""
    _created.clear()
    _created_run[0] = None
    _created_log[0] = None
    if cfg.run_num != AUTO:
        run_dir = run_dir_for(cfg, world_size)
        existed = os.path.isdir(run_dir)
        _make_dirs(cfg, run_dir)
        note = lock_run_dir(run_dir)
        if not existed:
            _created_run[0] = os.path.abspath(run_dir)
        elif not os.path.exists(os.path.join(run_dir, "out.log")):
            _created_log[0] = os.path.abspath(os.path.join(run_dir, "out.log"))
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
        except FileExistsError:
            number += 1
            continue
        except OSError as e:
            raise _cannot_create(cfg, run_dir, e) from None
        try:
            note = lock_run_dir(run_dir)
        except RunInUse:  # a run started with --run_num <number> locked it first
            number += 1
            continue
        _created.append(os.path.abspath(run_dir))
        _created_run[0] = os.path.abspath(run_dir)
        return str(number), (f"--run_num auto: the next free number under {parent}"
                             + (f"; {note}" if note else ""))


def _make_dirs(cfg: Config, path: str):
    """``os.makedirs``, noting the directories it creates (``discard_unstarted_run``)."""
    missing, probe = [], os.path.abspath(path)
    while not os.path.exists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise _cannot_create(cfg, path, e) from None
    _created.extend(reversed(missing))


# The directories this process created for the run it is starting, outermost first: a start that
# fails in set-up removes them again, so that it leaves no run behind (nor uses up its number).
_created: list[str] = []
_created_run: list[str | None] = [None]  # the run directory itself, when this process made it
# the out.log a start in a run directory that existed without one is about to create
_created_log: list[str | None] = [None]


def discard_unstarted_run():
    """After a start that failed before training (in set-up): remove the run directory this
    process created for it (its out.log and lock with it) and the parents it created, when they
    are empty. A run directory that existed before (a named run, a resumed one) stays, without
    the out.log this start wrote there when it had none."""
    root = logging.getLogger()
    for path in [*reversed(_created), *filter(None, _created_log)]:
        for h in list(root.handlers):  # out.log: closed before it or its directory goes
            if isinstance(h, logging.FileHandler) and (
                    h.baseFilename == path or h.baseFilename.startswith(path + os.sep)):
                root.removeHandler(h)
                h.close()
        if path == _created_log[0]:
            with contextlib.suppress(OSError):
                os.remove(path)
            continue
        if path == _created_run[0] and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only when empty: another run may have come meanwhile
    _created.clear()
    _created_run[0] = None
    _created_log[0] = None


def _cannot_create(cfg: Config, path: str, e: OSError) -> ConfigError:
    return ConfigError(f"expdir={cfg.expdir}: cannot create the run directory {path} "
                       f"({e.strerror}): choose a directory you can write to")


# ----------------------------------------------------------------------------- the run's lock

LOCK_NAME = ".run.lock"
HOST = socket.gethostname()
_held: dict[str, int] = {}  # lock file -> the process holding it (a forked child holds none)


class RunInUse(ConfigError):
    """Another process holds the run directory's lock."""


def lock_run_dir(run_dir: str) -> str:
    """Take ``run_dir``'s lock for this process (a process that holds it already keeps it).
    Returns a note for the log when it took over the lock of a process that no longer runs, ""
    otherwise. ConfigError (one line: which process holds it, and what to do) when another
    process of this host that still runs holds it, or a process of another host (whether that
    one still runs cannot be told from here)."""
    path = os.path.join(run_dir, LOCK_NAME)
    note = ""
    try:
        for _ in range(100):
            if _held.get(path) == os.getpid():
                return note
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                record = _read_lock(path)
                if record is None:
                    continue  # released meanwhile: try again
                if record.get("host") == HOST and record.get("pid") == os.getpid():
                    _held[path] = os.getpid()  # its own (a second Trainer in one process)
                    continue
                earlier = _earlier_attempt_of_this_job(record)
                if not earlier and (record.get("host") != HOST
                                    or not isinstance(record.get("pid"), int)):
                    raise RunInUse(_held_elsewhere(run_dir, path, record)) from None
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
            _held[path] = os.getpid()
            return note
    except OSError as e:
        raise ConfigError(f"cannot take the lock {path} ({e.strerror}): choose an --expdir you "
                          f"can write to") from None
    raise ConfigError(f"cannot take the lock {path}: it keeps changing hands; start the run again")


def release_run_locks():
    """Remove the run locks this process holds: when its run ends (finished, failed on an
    error, or stopped by a signal), and at exit. A forked child (a loader worker) removes none."""
    for path, pid in list(_held.items()):
        del _held[path]
        if pid != os.getpid():
            continue
        record = _read_lock(path)
        if record and record.get("host") == HOST and record.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".takeover")


atexit.register(release_run_locks)


def _lock_record() -> dict:
    pid = os.getpid()
    return {"host": HOST, "pid": pid, "start": _start_time(pid),
            "since": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:300],
            **_slurm_attempt()}


def _slurm_attempt() -> dict:
    """The Slurm job and how often it was requeued, inside a batch job."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    try:
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return {"slurm_job": job, "slurm_restart": restarts}


def _earlier_attempt_of_this_job(record: dict) -> bool:
    """The lock was taken by an earlier attempt of this Slurm job, which was requeued since (a
    preempted job killed before it could remove its lock, or one whose node failed): that attempt
    has ended, on whichever node it ran, since Slurm runs one attempt of a job at a time."""
    mine = _slurm_attempt()
    theirs = record.get("slurm_restart")
    return bool(mine) and record.get("slurm_job") == mine["slurm_job"] and \
        isinstance(theirs, int) and theirs < mine["slurm_restart"]


def _holder(record: dict) -> str:
    job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
    return (f"process {record.get('pid')} on {record.get('host')} (since {record.get('since')}"
            f"{job}: {record.get('command')})")


def _held_elsewhere(run_dir: str, path: str, record: dict) -> str:
    if not record:
        who = f"the lock file {path} names no process"
    else:
        who = f"{_holder(record)} holds it (lock {path}); whether it still runs cannot be told " \
              f"from {HOST}"
    return (f"run directory {run_dir} is locked: {who}: if no run of it is going on (its process "
            f"was killed, or its node lost), remove {path} and start again; else wait for that "
            f"run to end, or start another run (another --run_num)")


def _read_lock(path: str) -> dict | None:
    """The lock's record; None when there is no lock; {} when it names no process (a holder
    that died between creating and writing it, after waiting a second for the write)."""
    for _ in range(20):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
            if isinstance(record, dict):
                return record
        except ValueError:
            pass
        time.sleep(0.05)
    return {}


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), which
    tells it from a later process that reuses its PID; None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` of this host runs, and is the one that started at ``start``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True  # no /proc: it exists
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return False
    return start is None or fields[19] == start


def _take_over(path: str, stale: dict) -> bool:
    """Remove the lock ``stale`` of a process that no longer runs, when it is still the lock:
    one process of this host at a time (``flock`` on ``.run.lock.takeover``), so that two takers
    never both remove it (the second finds the first's lock instead)."""
    guard = os.open(path + ".takeover", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if _read_lock(path) != stale:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(guard)


# How long the other ranks wait for rank 0 to write synthetic data: far beyond any synthesis, so
# that only a dead rank 0 (its connection closes, and the wait fails at once) ends the wait.
SYNTHESIS_WAIT = datetime.timedelta(hours=24)


def ensure_data(cfg: Config, rt: Runtime):
    """Synthesise small data under data_root when the config asks for it and none is there (not
    for generated batches, which need no data): once, however many runs need it at the same time
    (``make_data_once``). A run on synthetic data made earlier says so, as the first run did."""
    if cfg.data_is_generated:
        return
    if has_data(cfg) and os.path.exists(os.path.join(cfg.data_root, synthetic.SYNTHETIC_MARK)):
        log.info(f"Data: the synthetic {cfg.model} data under {cfg.data_root} (made by an "
                 f"earlier run: not real data)")
        return
    if not cfg.synthesize_if_missing:
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
    # validation file is still to come), in a gloo group of their own: full-size synthesis (or
    # the wait for another run making it) can outlast the default group's dist_timeout_s, and
    # NCCL's watchdog would end the run.
    waiting = dist.new_group(backend="gloo", timeout=SYNTHESIS_WAIT) if rt.distributed else None
    outcome = [None]
    if rt.is_main:
        others = f"; the other {rt.world_size - 1} rank(s) wait for it" if rt.distributed else ""
        try:
            make_data_once(cfg, others)
        except UserError as e:
            outcome = [e]  # every rank raises it
    if waiting is not None:
        dist.broadcast_object_list(outcome, src=0, group=waiting)
        dist.destroy_process_group(waiting)
    if outcome[0] is not None:
        raise outcome[0]


def make_data_once(cfg: Config, others: str = "") -> bool:
    """Make the synthetic data set at data_root unless it is there; True when this process made
    it. Runs that need the same data set at the same time take turns on ``<data_root>.lock``
    (``flock``, waiting): the first makes it, the others find it made. The set is written into
    ``<data_root>.staging-<host>-<pid>`` beside data_root and renamed to data_root when complete
    (data_root must not exist, be empty, or be an earlier synthetic set that holds nothing else:
    check_synthesis_target), so a maker that dies leaves no data_root that looks whole, only its
    staging directory, which the next maker removes. A data_root that cannot be written is a
    ConfigError naming the path."""
    root = os.path.realpath(cfg.data_root)
    parent, name = os.path.split(root)
    try:
        _check_can_make(cfg, root, parent)
        with _data_lock(root + ".lock", root):
            _remove_leftovers(parent, name)  # first: it may put back a data_root (see there)
            if has_data(cfg):
                log.info(f"Data under {cfg.data_root}: made by another run in the meantime")
                return False
            check_synthesis_target(cfg)
            if os.path.isdir(root) and os.listdir(root):  # passed the check: marked, ours only
                log.info(f"Incomplete synthetic data under {cfg.data_root} (missing: "
                         f"{', '.join(missing_data(cfg))}): regenerating synthetic {cfg.model} "
                         f"data there (synthesize_if_missing is set for this config){others}")
            else:
                log.info(f"No data under {cfg.data_root}: generating synthetic {cfg.model} data "
                         f"there (synthesize_if_missing is set for this config){others}")
            t0 = time.time()
            staging = os.path.join(parent, f"{name}.staging-{HOST}-{os.getpid()}")
            try:
                synthesize(dataclasses.replace(cfg, data_root=staging))
                _publish(staging, root, f"data_root={cfg.data_root}")
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            log.info(f"Synthetic data written in {time.time() - t0:.1f} s")
            return True
    except OSError as e:
        raise _cannot_write(cfg, e) from None


def _check_can_make(cfg: Config, root: str, parent: str):
    """The checks that tell why synthetic data cannot be made at ``root`` before any is made."""
    where = f"data_root={cfg.data_root}"
    fix = ("choose a --data_root in a directory you can write to (synthetic data is made beside "
           "it and renamed into place), or put a data set there")
    if os.path.isdir(root) and not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user, and synthetic data must be "
                          f"written there (synthesize_if_missing): {fix}")
    if os.path.isdir(root) and os.path.ismount(root):
        raise ConfigError(f"{where} is a mount point, which the finished synthetic data set "
                          f"cannot be renamed onto: choose a directory below it, e.g. "
                          f"--data_root {os.path.join(cfg.data_root, 'synthetic')}")
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{where}: {probe} is a file, not a directory: choose a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {probe} is not writable by this user: {fix}")
    os.makedirs(parent, exist_ok=True)


def _cannot_write(cfg: Config, e: OSError) -> UserError:
    path = f" {e.filename}" if e.filename else ""
    reason = e.strerror or " ".join(str(e).split())
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return ConfigError(f"data_root={cfg.data_root}: synthetic data cannot be written there "
                           f"({reason}:{path}): choose a --data_root in a directory you can "
                           f"write to (synthetic data is made beside it and renamed into "
                           f"place), or put a data set there")
    return DataError(f"data_root={cfg.data_root}: writing synthetic data failed ({reason}:"
                     f"{path}): free space there or choose another --data_root; no partial data "
                     f"set was left")


@contextlib.contextmanager
def _data_lock(path: str, root: str):
    """Hold ``flock`` on ``path``, waiting for a process that holds it. The holder removes the
    file when done; a waiter that then holds the lock of the removed file opens it afresh."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                with contextlib.suppress(OSError), open(path) as f:
                    holder = f.read().strip()
                holder = holder or "another process"
                log.info(f"Waiting for {holder} to finish the synthetic data set {root} "
                         f"(lock {path})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {HOST}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _remove_leftovers(parent: str, name: str):
    """What makers that died left (only the lock's holder makes data): staging directories, and
    an earlier set that ``_publish`` had moved aside, which goes back to data_root when that is
    missing (the maker died between the two renames), else is removed (it had been checked)."""
    root = os.path.join(parent, name)
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if entry.startswith(f"{name}.old-") and not os.path.lexists(root):
            os.rename(path, root)
            log.info(f"Put back {root} from {path}, where a synthesis that did not finish had "
                     f"moved it")
        elif entry.startswith((f"{name}.staging-", f"{name}.old-")):
            shutil.rmtree(path, ignore_errors=True)
            log.info(f"Removed {path}, left by a synthesis that did not finish")


def _publish(staging: str, root: str, name: str):
    """Rename the complete set ``staging`` to ``root``: one step when ``root`` does not exist or
    is an empty directory. An earlier, incomplete synthetic set there is moved aside, checked
    again (``datapipe.synthetic.check_target`` against what ``staging`` holds: a file added since
    the check before synthesis is not the generator's) and only then removed; one that fails goes
    back to ``root`` untouched (ConfigError naming the files, ``name`` naming data_root)."""
    try:
        os.rename(staging, root)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        old = f"{root}.old-{HOST}-{os.getpid()}"
        os.rename(root, old)
        try:
            synthetic.check_target(old, synthetic.list_files(staging), name, "--data_root",
                                   f"{name} is no longer marked synthetic "
                                   f"({synthetic.SYNTHETIC_MARK}): it is not replaced; choose "
                                   f"another --data_root")
        except ConfigError:
            os.rename(old, root)
            raise
        os.rename(staging, root)
        shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(root), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself durable
    finally:
        os.close(fd)


def write_config(cfg: Config, run_dir: str, derived: dict, resumed: bool):
    """The resolved config, readable back with --yaml_config, as ``<run_dir>/config.yaml``
    (a resumed run keeps the file of the run it continues)."""
    path = os.path.join(run_dir, "config.yaml")
    if not resumed or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(dump(cfg, derived))
    log.info(f"Resolved config: {path} (all settings; python train.py --help lists them)")


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
