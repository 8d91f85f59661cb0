"""ERA5 ``read_batch`` against the raw read and the memory-copy rate, whole images and row bands.

    python -m benchmarks.era5_reads                      # 360 x 720, batch 4, 7 rounds
    python -m benchmarks.era5_reads --rounds 9 --data /tmp/era5_360x720   # keep the data

Data: synthetic ERA5 (``datapipe.synthetic``) at ``--img_size``, 20 channels, two training years
of ``--steps`` steps (250 MB each at 360 x 720), written contiguous and uncompressed as
``make_era5`` writes them, read from the page cache (every file is read once before timing).

Every variant fills the same preallocated, already touched batch arrays (B, 20, rows, W) for
input and target (as pooled batch buffers would be) with the same keys, so only the read and
its checks are timed:

* memory copy: ``np.copyto`` of the same bytes from memory into the batch (the copy ceiling);
* raw pread: one ``os.preadv`` per field of the same bytes (the page cache's copy rate, no check);
* raw mmap copy: ``np.copyto`` from the files mapped into memory, every page already mapped in
  this process (a copy from the page cache without a system call or a fault; no check);
* raw h5py: ``read_direct`` of the same hyperslabs (what h5py alone reaches, no check);
* read_batch before: the dataset before reads by offset (``utils/era5_data.py`` of commit
  4635056, the parent of 48e8702 that brought them in, taken from git: h5py ``read_direct`` per
  field, then one finite check over the batch; the script refuses to start where git or that
  commit is not at hand, e.g. in a shallow clone);
* read_batch now, N threads: reads by offset over N threads, each piece checked as it lands.

Processes 2: two processes (forked, one torch thread each, as loader workers) run the same
variant at once, each on its own batch arrays; the rates are their total. Rounds are
interleaved (every variant once per round) and the best round is reported, as samples/s (input +
target pairs) and GB/s. On a shared machine the rates with 2 threads or processes depend on
whether the second core is idle: run it again (a raw h5py row at 2 processes no higher than at 1
says the second core was busy).
"""
from __future__ import annotations

import importlib
import io
import mmap
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import h5py
import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datapipe import era5_data, synthetic  # noqa: E402
from settings.errors import OneLineParser, at_least, refuse  # noqa: E402

# The read path before reads by offset: the parent of commit 48e8702 ("ERA5 year files stored
# contiguous as little-endian float32 are read by byte offset"), where the dataset was
# utils/era5_data.py (with the modules it imports from utils/).
BEFORE = "46350567505a3996acfde4686ba97168867d1a8d"
BEFORE_FILES = ("utils/__init__.py", "utils/era5_data.py", "utils/batch_dataset.py",
                "utils/errors.py")


def old_module():
    """utils/era5_data.py of commit ``BEFORE`` (the read path before reads by offset), imported
    from a copy of that commit's files; refused in one line where git or the commit is not at
    hand."""
    try:
        archive = subprocess.run(["git", "-C", ROOT, "archive", BEFORE, *BEFORE_FILES],
                                 check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or str(e)
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else detail
        refuse(f"the 'read_batch before' rows need commit {BEFORE[:7]} of this repository from "
               f"git ({' '.join(detail.split()) or 'git failed'}): run the script in a git clone "
               f"with the project's history (git fetch --unshallow in a shallow one)")
    saved = {k: v for k, v in sys.modules.items() if k == "utils" or k.startswith("utils.")}
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            try:
                tar.extractall(tmp, filter="data")
            except TypeError:  # a Python without extraction filters
                tar.extractall(tmp)
        sys.path.insert(0, tmp)
        try:
            for k in saved:
                del sys.modules[k]
            return importlib.import_module("utils.era5_data")
        finally:  # that commit's package, under its own names only while it is imported
            sys.path.remove(tmp)
            for k in [k for k in sys.modules if k == "utils" or k.startswith("utils.")]:
                del sys.modules[k]
            sys.modules.update(saved)


class Variants:
    def __init__(self, data, img_size, rows, batch, before, seed=0):
        kw = dict(data_root=data, img_size=img_size, rows=rows)
        self.new = era5_data.ERA5Dataset(os.path.join(data, "train"), **kw)
        assert all(lay is not None for lay in self.new._layouts), "not stored contiguous float32"
        self.old = before.ERA5Dataset(os.path.join(data, "train"), **kw)
        self.rows, self.w, self.batch = self.new.rows, img_size[1], batch
        self.rng = np.random.default_rng(seed)
        sx, sy = self.new.sample_shapes
        self.x, self.y = np.ones((batch, *sx), np.float32), np.ones((batch, *sy), np.float32)
        self.src = np.random.default_rng(1).standard_normal((2, *self.x.shape), np.float32)
        self.h5 = [h5py.File(p, "r")["fields"] for p in self.new.files]
        self.fds = [os.open(p, os.O_RDONLY) for p in self.new.files]
        self.maps = []
        for fd, (offset, shape) in zip(self.fds, self.new._layouts):
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            a = np.frombuffer(m, np.float32, int(np.prod(shape)), offset).reshape(shape)
            a.max()  # every page mapped in this process once
            self.maps.append(a)
        self.bytes = self.x.nbytes + self.y.nbytes

    def keys(self):
        return [int(k) for k in self.rng.integers(0, len(self.new), self.batch)]

    def fields(self, keys):
        """(file, step, destination) of every field of the batch: inputs then targets."""
        where = [self.new.locate(k) for k in keys]
        return ([(k, t, self.x[j]) for j, (k, t) in enumerate(where)]
                + [(k, t + self.new.dt, self.y[j]) for j, (k, t) in enumerate(where)])

    def copy(self, keys):
        np.copyto(self.x, self.src[0])
        np.copyto(self.y, self.src[1])

    def pread(self, keys):
        start, stop = self.rows
        for k, t, out in self.fields(keys):
            offset, (_, c, h, w) = self.new._layouts[k]
            assert out.shape[2] == w, "raw pread times whole-width rows only"
            for ch in range(out.shape[0]):  # one run of bytes per channel (whole images: per field)
                at = offset + ((t * c + ch) * h + start) * w * 4
                os.preadv(self.fds[k], [memoryview(out[ch]).cast("B")], at)

    def mmap(self, keys):
        band = slice(*self.rows)
        for k, t, out in self.fields(keys):
            np.copyto(out, self.maps[k][t, : out.shape[0], band, : self.w])

    def h5py(self, keys):
        band = slice(*self.rows)
        for k, t, out in self.fields(keys):
            self.h5[k].read_direct(out, np.s_[t, : out.shape[0], band, : self.w])

    def before(self, keys):
        self.old.read_batch(keys, self.x, self.y)

    def now(self, keys):
        self.new.read_batch(keys, self.x, self.y)


READ_THREADS = era5_data.read_threads


def with_threads(n, fn):
    """``fn`` with ``read_batch`` reading over ``n`` threads (whatever ``read_threads()`` says)."""
    def run(keys):
        era5_data.read_threads = lambda: n
        try:
            fn(keys)
        finally:
            era5_data.read_threads = READ_THREADS
    return run


def timed(v: Variants, fn, n_batches):
    keys = [v.keys() for _ in range(n_batches)]
    fn(keys[0])  # warm: handles open, threads started
    t0 = time.perf_counter()
    for k in keys:
        fn(k)
    return time.perf_counter() - t0


def _child(v, fn, n_batches, barrier, conn):
    torch.set_num_threads(1)  # as in a DataLoader worker (a forked OpenMP pool would hang)
    v.rng = np.random.default_rng(os.getpid())
    v.x, v.y = v.x.copy(), v.y.copy()  # this process's own batch arrays, touched
    keys = [v.keys() for _ in range(n_batches)]
    fn(keys[0])
    barrier.wait()
    t0 = time.perf_counter()
    for k in keys:
        fn(k)
    conn.send(time.perf_counter() - t0)


def timed_processes(v: Variants, fn, n_batches, n_proc=2):
    """Wall time for n_proc forked processes, each reading n_batches (started together)."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n_proc)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n_proc)]
    procs = [ctx.Process(target=_child, args=(v, fn, n_batches, barrier, w)) for _, w in pipes]
    for p in procs:
        p.start()
    times = [r.recv() for r, _ in pipes]
    for p in procs:
        p.join()
    return max(times) / n_proc  # per batch-equivalent of one process: total rate = n_proc x


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.era5_reads", description=__doc__.splitlines()[0])
    p.add_argument("--img_size", type=at_least(1), nargs=2, default=(360, 720),
                   help="height and width of the synthetic fields")
    p.add_argument("--band", type=at_least(0), nargs=2, default=(96, 184),
                   help="the row band timed beside whole images (a quarter at 4x4 on 360 x 720)")
    p.add_argument("--steps", type=at_least(2), default=12,
                   help="time steps per synthetic year file (2 or more: a sample is a pair)")
    p.add_argument("--batch", type=at_least(1), default=4, help="samples per batch")
    p.add_argument("--batches", type=at_least(1), default=6, help="batches per measurement")
    p.add_argument("--rounds", type=at_least(1), default=7,
                   help="interleaved rounds; each figure is the best round")
    p.add_argument("--data", help="directory for the synthetic data (kept); default: a temporary one")
    args = p.parse_args(argv)
    try:
        era5_data.check_rows(tuple(args.band), args.img_size[0])
    except ValueError:
        start, stop = args.band
        refuse(f"--band {start} {stop} is not a band of the {args.img_size[0]} image rows of "
               f"--img_size {args.img_size[0]} {args.img_size[1]}: give START STOP with 0 <= START "
               f"< STOP <= {args.img_size[0]}")
    before = old_module()

    data = args.data or tempfile.mkdtemp(prefix="era5_reads_")
    try:
        if not os.path.isdir(os.path.join(data, "train")):
            synthetic.make_era5(data, img_size=tuple(args.img_size), steps_per_year=args.steps,
                                train_years=(2016, 2017), valid_years=(2018,), test_years=(), seed=0)
        for f in sorted(os.listdir(os.path.join(data, "train"))):  # into the page cache
            with open(os.path.join(data, "train", f), "rb") as fh:
                while fh.read(1 << 26):
                    pass
        default = era5_data.read_threads()
        print(f"CPUs {len(os.sched_getaffinity(0))}, read_threads() here: {default}; "
              f"best of {args.rounds} interleaved rounds of {args.batches} batches of {args.batch}\n")
        print("| rows | variant | processes | samples/s | GB/s | ratio to raw h5py |")
        print("|---|---|---|---:|---:|---:|")
        for rows in (None, tuple(args.band)):
            v = Variants(data, tuple(args.img_size), rows, args.batch, before)
            cases = [("memory copy", v.copy, 1), ("raw pread", v.pread, 1),
                     ("raw mmap copy", v.mmap, 1), ("raw h5py", v.h5py, 1),
                     ("read_batch before", v.before, 1),
                     ("read_batch now, 1 thread", with_threads(1, v.now), 1),
                     ("read_batch now, 2 threads", with_threads(2, v.now), 1),
                     ("raw h5py", v.h5py, 2), ("read_batch before", v.before, 2),
                     ("read_batch now, 1 thread", with_threads(1, v.now), 2),
                     ("read_batch now, 2 threads", with_threads(2, v.now), 2)]
            best = [float("inf")] * len(cases)
            for _ in range(args.rounds):
                for i, (_, fn, procs) in enumerate(cases):
                    t = (timed(v, fn, args.batches) if procs == 1
                         else timed_processes(v, fn, args.batches, procs))
                    best[i] = min(best[i], t)
            raw = {procs: best[i] for i, (name, _, procs) in enumerate(cases) if name == "raw h5py"}
            label = f"all {args.img_size[0]}" if rows is None else f"{rows[0]}:{rows[1]}"
            for (name, _, procs), t in zip(cases, best):
                n = args.batches * args.batch
                print(f"| {label} | {name} | {procs} | {n / t:.1f} | {v.bytes * args.batches / t / 1e9:.2f} "
                      f"| {raw.get(procs, raw[1]) / t:.2f} |")
            print(f"|  | ({v.bytes / args.batch / 1e6:.1f} MB per sample pair) | | | | |")
    finally:
        if not args.data:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
