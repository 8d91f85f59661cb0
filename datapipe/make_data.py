"""Synthetic data made for a run that asks for it (``synthesize_if_missing``), once however many
runs need it at the same time (docs/data.md, "Synthetic data"): runs take turns on
``<data_root>.lock`` (``flock``), and the first makes the set beside data_root, renamed into place.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from typing import TYPE_CHECKING

from datapipe import synthetic
from datapipe.data_sets import data_set
from settings.errors import ConfigError, DataError, UserError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)

HOST = socket.gethostname()

# How long the other ranks wait for rank 0 to write synthetic data: far beyond any synthesis, so
# that only a dead rank 0 (its connection closes, and the wait fails at once) ends the wait.
SYNTHESIS_WAIT = datetime.timedelta(hours=24)


def make_data_once(cfg: Config, others: str = "") -> bool:
    """Make the synthetic data set at data_root unless it is there; True when this process made
    it. A maker that dies leaves only ``<data_root>.staging-<host>-<pid>``, which the next one
    removes. A data_root that cannot be written is a ConfigError naming the path."""
    root = os.path.realpath(cfg.data_root)
    parent, name = os.path.split(root)
    try:
        _check_can_make(cfg, root, parent)
        with file_lock(root + ".lock", f"finish the synthetic data set {root}"):
            _remove_leftovers(parent, name)  # first: it may put back a data_root (see there)
            if has_data(cfg):
                log.info(f"Data under {cfg.data_root}: made by another run in the meantime")
                return False
            check_synthesis_target(cfg)
            if os.path.isdir(root) and os.listdir(root):  # passed the check: marked, ours only
                log.info(f"Incomplete synthetic data under {cfg.data_root} (missing: "
                         f"{', '.join(data_set(cfg).missing())}): regenerating synthetic {cfg.model} "
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


_WRITABLE_ROOT = ("choose a --data_root in a directory you can write to (synthetic data is made "
                  "beside it and renamed into place), or put a data set there")


def _check_can_make(cfg: Config, root: str, parent: str):
    """The checks that tell why synthetic data cannot be made at ``root`` before any is made."""
    where, fix = f"data_root={cfg.data_root}", _WRITABLE_ROOT
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
                           f"({reason}:{path}): {_WRITABLE_ROOT}")
    return DataError(f"data_root={cfg.data_root}: writing synthetic data failed ({reason}:"
                     f"{path}): free space there or choose another --data_root; no partial data "
                     f"set was left")


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
    """Rename the complete set ``staging`` to ``root``. An earlier, incomplete synthetic set there
    is moved aside, checked again (a file added since the first check is not the generator's)
    and only then removed; one that fails goes back to ``root`` untouched (a ConfigError)."""
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


def has_data(cfg: Config) -> bool:
    return not data_set(cfg).missing()


def check_synthesis_target(cfg: Config):
    """``datapipe.synthetic.check_target`` for data_root and the data set's ``synthetic_files``."""
    root, data = cfg.data_root, data_set(cfg)
    listed = getattr(data, "synthetic_files", None)  # none listed: a marked root is never replaced
    synthetic.check_target(
        root, listed() if listed is not None else [], f"data_root={root}", "--data_root",
        f"data_root={root} holds files but not a complete {cfg.model} data set (missing: "
        f"{', '.join(data.missing())}); synthetic data is written only into a new or empty "
        f"directory: complete the data set there, or choose another --data_root")


def synthesize(cfg: Config):
    """Write small synthetic data, marked as such, under data_root (a new staging directory)."""
    data_set(cfg).synthesize()


# ------------------------------------------------------------------ one process at a time

@contextlib.contextmanager
def file_lock(path: str, waiting_for: str = ""):
    """Hold ``flock`` on ``path``, waiting for a process that holds it (with a line naming that
    process when ``waiting_for`` says what it is doing). The file names its holder while held; the
    holder removes it when done, and a waiter that then holds the lock of the removed file opens
    it afresh."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting_for:
                    holder = ""
                    with contextlib.suppress(OSError), open(path) as f:
                        holder = f.read().strip()
                    log.info(f"Waiting for {holder or 'another process'} to {waiting_for} "
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
