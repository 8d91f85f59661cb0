"""Shared fixtures: tiny data files in the real formats, with contents that make alignment,
normalisation and rotation checkable by eye and by assertion."""
import faulthandler
import hashlib
import os
import sys

import h5py
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Under ``-n N`` each worker takes its share of the cores for torch's intra-op threads, and so
# do the processes its tests start (they inherit the variable): N workers each with a thread per
# core would wait on each other's threads, as a run beside a busy process does (README, the CPU
# paragraph of Training). Set before torch loads here; a value the caller gave is kept.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _workers))

from datapipe.batch_pool import exit_with_parent  # noqa: E402 - after the path is set

# Per-channel offsets and scales of the fixture ERA5 fields (what the stats files say).
ERA5_MEANS = np.linspace(-50, 50, 20).astype(np.float32)
ERA5_STDS = np.linspace(1, 20, 20).astype(np.float32)


def file_digests(root) -> dict:
    """{path relative to ``root``: sha256} of every file under ``root``: what a test compares
    before and after an operation that must change nothing on disk."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def era5_value(year, t, c, h, w):
    """Raw value of the fixture ERA5 field: encodes (year, t, c) plus a spatial pattern."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return ERA5_MEANS[c] + ERA5_STDS[c] * (0.01 * (year - 2000) + 0.1 * t + 0.001 * hh - 0.0005 * ww)


def write_era5(root, years=None, steps=12, h=16, w=32, dtype=np.float32):
    """Year files of ``fields`` stored as ``dtype`` (float32 as the tutorial data; users' own
    files may hold float64 or integers), and the stats."""
    years = years or {"train": [2016, 2017], "valid": [2018]}
    for split, ys in years.items():
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for y in ys:
            f = np.stack([np.stack([era5_value(y, t, c, h, w) for c in range(20)]) for t in range(steps)])
            with h5py.File(os.path.join(root, split, f"{y}.h5"), "w") as hf:
                hf["fields"] = f.astype(dtype)
    os.makedirs(os.path.join(root, "stats"), exist_ok=True)
    np.save(os.path.join(root, "stats", "global_means.npy"), ERA5_MEANS.reshape(1, 20, 1, 1))
    np.save(os.path.join(root, "stats", "global_stds.npy"), ERA5_STDS.reshape(1, 20, 1, 1))
    np.save(os.path.join(root, "stats", "time_means.npy"),
            np.broadcast_to(ERA5_MEANS.reshape(1, 20, 1, 1), (1, 20, h, w)).astype(np.float32))
    return root


@pytest.fixture
def era5_root(tmp_path):
    return write_era5(str(tmp_path / "era5"))


def write_cosmo(path, side=16, seed=0, dtype=np.float32):
    """Nbody: [position code, vx, vy, vz] with v = a smooth field; Hydro: pointwise functions of
    Nbody, so a correctly aligned, correctly rotated sample satisfies them exactly. Both stored
    as ``dtype``."""
    rng = np.random.default_rng(seed)
    idx = np.arange(side)
    x, y, z = np.meshgrid(idx, idx, idx, indexing="ij")
    code = (x * side * side + y * side + z).astype(np.float32) / side**3
    v = rng.standard_normal((3, side, side, side)).astype(np.float32)
    nbody = np.concatenate([code[None], v])
    hydro = np.concatenate([2 * code[None], code[None] ** 2, 3 * v])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with h5py.File(path, "w") as f:
        f["Nbody"] = nbody.astype(dtype)
        f["Hydro"] = hydro.astype(dtype)
    return path


def write_cosmo_pair(root, side=16, dtype=np.float32) -> str:
    """``train.h5`` and ``valid.h5`` (seeds 0 and 1) of ``side``^3 under ``root``."""
    write_cosmo(os.path.join(root, "train.h5"), side=side, seed=0, dtype=dtype)
    write_cosmo(os.path.join(root, "valid.h5"), side=side, seed=1, dtype=dtype)
    return str(root)


@pytest.fixture
def cosmo_root(tmp_path):
    return write_cosmo_pair(tmp_path / "cosmo")


# ----------------------------------------------------------------------------- the quick tier

SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    """``-m quick``: every test but those listed in slow_tests.txt and the Slurm, compile and
    GPU ones (a few minutes on 2 cores instead of a quarter of an hour)."""
    with open(SLOW_TESTS) as f:
        slow = {line.split("  #", 1)[0].strip() for line in f if not line.startswith("#")} - {""}
    modules = {entry for entry in slow if entry.endswith(".py")}  # whole files
    # The Slurm file first: its jobs spend minutes waiting on Slurm's clock, which a second
    # worker (-n 2) fills with the other files instead of waiting at the end for it.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_slurm.py"))
    for item in items:
        if (item.nodeid in slow or item.nodeid.split("::")[0] in modules
                or any(item.get_closest_marker(m) for m in ("slurm", "compile", "gpu"))):
            continue
        item.add_marker(pytest.mark.quick)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n 2`` (pytest-xdist): each file runs whole on one worker, so a file's module fixtures
    (reference runs, spawned ranks) are made once, and files go out in the order collected."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # xdist would put the files with most tests first
    return LoadFileScheduling(config, log)


# ----------------------------------------------------------------------------- hangs and crashes

TEST_LIMIT_S = 600  # over 3x the longest test here (a Slurm job's: 192 s in a full run on 2 cores)
STDERR = 2  # where a hung test's stacks go: the real stderr, once pytest_configure has it


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """``-n 2``: a worker that crashes ends the run (unless ``--max-worker-restart`` says
    otherwise). xdist would start another and run the test it crashed in again, and a test that
    hangs would take ``TEST_LIMIT_S`` each time. And a copy of fd 2 taken while pytest does not
    capture it (it does during tests)."""
    global STDERR
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"
    STDERR = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that hangs, even in a wait in C that no signal handler ends, prints every thread's
    stack and ends its process after ``TEST_LIMIT_S``: under ``-n 2`` xdist reports the test as
    the one its worker crashed in, where it would otherwise wait to the end of the run."""
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True, file=STDERR)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _forking():
    global FORKED_BY
    FORKED_BY = os.getpid()


def _end_with_the_test_process():
    """A process forked from a test's (a loader's workers) is killed when that process ends: it
    holds every file that process had open, an xdist worker's pipes to pytest among them, and
    had the worker crashed, xdist would see its pipes open and wait for it to the run's end."""
    exit_with_parent(FORKED_BY)


FORKED_BY = 0
os.register_at_fork(before=_forking, after_in_child=_end_with_the_test_process)
