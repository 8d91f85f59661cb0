"""Bytes read and samples/s per rank of the ERA5 training loader: whole samples against the rank's rows.

    python -m benchmarks.band_reads                       # tp=1, tp=4, cp=2, 4x4 at 360 x 720; tp=4 at 352 x 720
    python -m benchmarks.band_reads --layouts 1x1 2x2@352 --rounds 5

Data: synthetic ERA5 year files (``datapipe.synthetic``) at ``--img_size`` with 20 channels, written
to a temporary directory (removed at the end unless ``--data`` names a directory to keep).

A layout ``TPxCP`` (optionally ``@HEIGHT``: the image cropped to that many rows, as ``img_size``
crops it) is the mp config's ViT (patch 8) at tensor_parallel TP x context_parallel CP. The rows
of each rank come from the engine's ``distributed.parallelize.token_layout``: the image is cut
into tp x cp row bands, or into cp bands (padded sequence parallelism, or none: every tp rank of
a cp rank embeds the whole cp band), whose lengths may differ by one patch row; a rank's
``(start, stop)`` are those of ``ParallelViT.image_rows()``.

"before": the training loader reads whole samples (``build_loaders(..., rows=None)``), as every
model-parallel rank did; "after": ``build_loaders(..., rows=image_rows)``. One process plays one
rank at a time (no workers, local batch ``--batch``), so the numbers are per rank. Per sample:

* MB read: bytes the process asked the file system for (``rchar`` of /proc/self/io), i.e. what
  h5py reads, input and target;
* warm samples/s: from the page cache (the files were just read): the loader's CPU cost;
* cold samples/s and MB from storage: the files' pages are dropped from the page cache
  (``posix_fadvise(DONTNEED)``) before every batch, so every batch comes from the disk;
  ``read_bytes`` includes the kernel's read-ahead.

Measurements are interleaved over ``--rounds`` rounds; samples/s is the best round, bytes the mean.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from distributed.parallelize import token_layout  # noqa: E402
from datapipe import synthetic  # noqa: E402
from settings.errors import OneLineParser, at_least, refuse  # noqa: E402
from settings.parse import build_config  # noqa: E402
from datapipe.data_loader import build_loaders  # noqa: E402

MB = 1e6
DEFAULT_LAYOUTS = ["1x1", "4x1", "1x2", "4x4", "4x1@352"]


def io_counters() -> tuple[int, int]:
    """(rchar, read_bytes) of this process: bytes requested by read calls, bytes from storage."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines() if line)
    return int(d["rchar"]), int(d["read_bytes"])


def drop_cache(paths):
    """Evict the files' clean pages from the page cache (no privileges needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 26):
                pass


def parse_layout(spec: str, height: int):
    """``"4x1"`` or ``"4x1@352"`` -> (tp, cp, image height)."""
    try:
        grid, _, h = spec.partition("@")
        tp, cp = (int(v) for v in grid.lower().split("x"))
        return tp, cp, int(h) if h else height
    except ValueError:
        raise ValueError(f"layout {spec!r} is not TPxCP or TPxCP@HEIGHT, e.g. 4x1 or 1x2@352") from None


def rank_bands(tp: int, cp: int, img_size, patch_size: int):
    """(description of the token layout, {(start, stop): [ranks of the replica]})."""
    lay = token_layout(img_size, patch_size, tp, cp)
    if lay.bands == 1:
        kind = "whole image" if lay.row_bands else "padded sequence parallel: whole image (cp = 1)"
    elif lay.row_bands:
        kind = f"{lay.bands} row bands (tp x cp)"
    else:
        kind = f"{'padded sequence parallel' if lay.padded else 'no sequence parallel'}: {cp} cp bands"
    bands = {}
    for r in range(tp * cp):  # r = c * tp + t: the tp rank varies fastest inside a cp rank
        start, stop = lay.band_rows(lay.band_index(r // tp, r % tp))  # patch rows, as ParallelViT.image_rows
        bands.setdefault((start * patch_size, stop * patch_size), []).append(r)
    return kind, bands


class Reader:
    """The training loader of one rank for one image height and row band, read batch by batch."""

    def __init__(self, data, height, width, rows, batch, files):
        cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "mp",
                           {"data_root": data, "img_size": f"[{height},{width}]",
                            "data_loader_config": "lowmem", "num_data_workers": "0"})
        self.patch_size = cfg.patch_size
        self.height = height if rows is None else rows[1] - rows[0]
        self.loader = build_loaders(cfg, 1, 0, batch, torch.device("cpu"), rows=rows).train
        self.files, self.epoch, self.it = files, 0, iter(())
        self.runs = {"warm": [], "cold": []}  # (MB read, MB from storage, samples/s) per round

    def _next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.loader.sampler.set_epoch(self.epoch)
            self.epoch += 1
            self.it = iter(self.loader)
            return next(self.it)

    def measure(self, n_batches: int, cold: bool):
        n, elapsed, rchar, storage = 0, 0.0, 0, 0
        for _ in range(n_batches):
            if cold:
                drop_cache(self.files)
            c0, t0 = io_counters(), time.perf_counter()
            x, _ = self._next()
            elapsed += time.perf_counter() - t0
            c1 = io_counters()
            assert x.shape[2] == self.height, (x.shape, self.height)
            rchar, storage, n = rchar + c1[0] - c0[0], storage + c1[1] - c0[1], n + x.shape[0]
        self.runs["cold" if cold else "warm"].append((rchar / n / MB, storage / n / MB, n / elapsed))

    def result(self, mode: str):
        runs = self.runs[mode]
        return (sum(r[0] for r in runs) / len(runs), sum(r[1] for r in runs) / len(runs),
                max(r[2] for r in runs))


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.band_reads", description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS,
                   help="TPxCP or TPxCP@HEIGHT (image cropped to HEIGHT rows)")
    p.add_argument("--img_size", type=at_least(1), nargs=2, default=[360, 720],
                   metavar=("H", "W"), help="image size of the synthetic files (default: %(default)s)")
    p.add_argument("--years", type=at_least(1), default=2, help="training year files")
    p.add_argument("--steps", type=at_least(2), default=12,
                   help="time steps per year file (2 or more: a sample is a pair)")
    p.add_argument("--batch", type=at_least(1), default=2, help="local batch size")
    p.add_argument("--batches", type=at_least(1), default=6, help="batches per measurement")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="repeats of each measurement: samples/s is the best round, MB read the "
                        "mean over the rounds")
    p.add_argument("--data", help="directory for the synthetic files (kept); default: a temporary one")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    H, W = args.img_size
    try:
        cases = [parse_layout(s, H) for s in args.layouts]
        for tp, cp, h in cases:
            if tp < 1 or cp < 1:
                raise ValueError(f"layout {tp}x{cp} has no ranks: give TP and CP of 1 or more, "
                                 f"e.g. 4x1")
            if not 0 < h <= H:
                raise ValueError(f"layout {tp}x{cp}@{h} crops to {h} rows; the files have {H}: "
                                 f"choose a height in 1..{H}")
    except ValueError as e:
        refuse(str(e))

    data = args.data or tempfile.mkdtemp(prefix="band_reads_")
    try:
        if not os.path.isdir(os.path.join(data, "train")):
            synthetic.make_era5(data, img_size=(H, W), steps_per_year=args.steps,
                                train_years=tuple(range(2016, 2016 + args.years)), valid_years=(2030,),
                                test_years=(), seed=0)
        files = sorted(os.path.join(data, "train", f) for f in os.listdir(os.path.join(data, "train")))
        print(f"# torch {torch.__version__}, {os.cpu_count()} CPU cores; {len(files)} year files of "
              f"{args.steps} steps at {H} x {W}, 20 channels; local batch {args.batch}, "
              f"{args.batches} batches x {args.rounds} rounds per measurement\n")

        readers, rows = {}, []  # readers by (height, band); rows: one per (layout, band)
        for tp, cp, h in cases:
            if (h, (0, h)) not in readers:
                readers[h, (0, h)] = Reader(data, h, W, None, args.batch, files)
            try:
                kind, bands = rank_bands(tp, cp, (h, W), readers[h, (0, h)].patch_size)
            except ValueError as e:
                rows.append((tp, cp, h, f"refused by the engine: {e}", None, None))
                continue
            for band, ranks in bands.items():
                if (h, band) not in readers:
                    readers[h, band] = Reader(data, h, W, band, args.batch, files)
                rows.append((tp, cp, h, kind, band, ranks))

        for mode in ("warm", "cold"):
            if mode == "warm":
                warm_cache(files)
            for _ in range(args.rounds):
                for r in readers.values():
                    r.measure(args.batches, cold=mode == "cold")

        print("| tp x cp | image | token layout | ranks | rows | MB read per sample, before -> after "
              "| warm samples/s, before -> after | cold samples/s, before -> after "
              "| cold MB from storage per sample, before -> after |")
        print("|---|---|---|---|---|---|---|---|---|")
        totals = {}
        for tp, cp, h, kind, band, ranks in rows:
            if band is None:
                print(f"| {tp} x {cp} | {h} x {W} | {kind} | | | | | | |")
                continue
            b, a = readers[h, (0, h)], readers[h, band]
            (bm, _, bw), (am, _, aw) = b.result("warm"), a.result("warm")
            (_, bs, bc), (_, as_, ac) = b.result("cold"), a.result("cold")
            rk = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
            print(f"| {tp} x {cp} | {h} x {W} | {kind} | {rk} | {band[0]}:{band[1]} | {bm:.1f} -> {am:.1f} "
                  f"| {bw:.1f} -> {aw:.1f} | {bc:.1f} -> {ac:.1f} | {bs:.1f} -> {as_:.1f} |")
            t = totals.setdefault((tp, cp, h), [0.0, 0.0])
            t[0] += bm * len(ranks)
            t[1] += am * len(ranks)
        print()
        for (tp, cp, h), (before, after) in totals.items():
            whole = readers[h, (0, h)].result("warm")[0]
            print(f"{tp} x {cp} at {h} x {W}: the {tp * cp} rank(s) of a replica read {before:.1f} MB per "
                  f"sample before, {after:.1f} MB after ({before / whole:.2f} and {after / whole:.2f} "
                  f"times one whole sample, {whole:.1f} MB)")
    finally:
        if not args.data:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
