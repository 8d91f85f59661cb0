"""What the loader tests share: a dataset whose samples say their key, a deadline that turns a
hang into a test failure, and the checks that nothing outlives a loader."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np

from datapipe.batch_dataset import BatchReadDataset
from datapipe.rotations import rotate_into, rotated_grid


def rotate_volume(x: np.ndarray, rot, vector_channels=()) -> np.ndarray:
    """The reference rotation: ``rotate_into`` a new contiguous array."""
    out = np.empty(rotated_grid(x, rot).shape, dtype=x.dtype)
    return rotate_into(x, rot, vector_channels, out)


class KeyedDataset(BatchReadDataset):
    """Sample ``k`` (an int) is ``x = [k, -k, k + 0.5]``, ``y = [2k]``: a batch shows which keys it
    holds. ``delay(keys)`` (seconds) slows a read; ``fail`` keys raise ``ValueError``. Workers
    are forked: what a test sets before the first pass, they have."""

    sample_shapes = ((3,), (1,))

    def __init__(self, n: int, delay=None, fail=()):
        self.n, self.delay, self.fail = n, delay, set(fail)

    def __len__(self):
        return self.n

    def read_batch(self, keys, x, y):
        if self.delay is not None:
            time.sleep(self.delay(keys))
        bad = self.fail.intersection(keys)
        if bad:
            raise ValueError(f"cannot read sample {min(bad)}")
        k = np.asarray(keys, np.float32)
        x[:, 0], x[:, 1], x[:, 2], y[:, 0] = k, -k, k + 0.5, 2 * k

    @staticmethod
    def keys_of(x, y) -> list[int]:
        """The keys a batch holds; AssertionError unless every row is a whole sample."""
        k = x[:, 0].numpy()
        want = np.stack([k, -k, k + 0.5], axis=1)
        assert np.array_equal(x.numpy(), want) and np.array_equal(y[:, 0].numpy(), 2 * k), \
            f"a batch whose rows are not whole samples: {x.numpy().tolist()}"
        return [int(v) for v in k]


class Deadline(Exception):
    """An operation ran past its deadline (raised in the main thread by SIGALRM)."""


@contextlib.contextmanager
def deadline(seconds: float, what: str, describe=None):
    """Run the body with a time limit: past it, SIGALRM raises ``Deadline`` wherever the main
    thread is (a wait on a pipe included: Python runs the handler between retries), so a hang
    fails the test with ``what`` (and what ``describe()`` says then) instead of hanging."""
    def expired(signum, frame):
        said = f": {describe()}" if describe is not None else ""
        raise Deadline(f"{what}: still running after {seconds} s (a hang){said}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids, seconds: float) -> list[int]:
    """The pids of ``pids`` still alive after up to ``seconds``."""
    end = time.monotonic() + seconds
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.01)
        left = [p for p in left if alive(p)]
    return left


def shm_names() -> set[str]:
    """The names in /dev/shm, but for files someone else made and removed meanwhile, the key
    files of DALI pipelines and the named semaphores of Python's multiprocessing (process pools,
    dask), which other tests run meanwhile (``pytest -n 2``); the loaders make neither."""
    first = set(os.listdir("/dev/shm"))
    time.sleep(0.02)
    return {n for n in first & set(os.listdir("/dev/shm"))
            if not n.startswith(("dali_keys_", "sem.mp-"))}


def in_shm() -> list[str]:
    """What this process has open or mapped in /dev/shm."""
    found = [m.split()[-1] for m in open("/proc/self/maps") if "/dev/shm/" in m]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/dev/shm/"):
            found.append(target)
    return found
