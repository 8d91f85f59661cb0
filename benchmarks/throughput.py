"""Loader throughput on this machine, beside the raw HDF5 read rate (the limit).

    python -m benchmarks.throughput                  # everything, prints Markdown tables
    python -m benchmarks.throughput --only loaders   # or: raw

Loader rows: each setting (DALI's where it is installed) and worker count beside the raw h5py
read of the same bytes, timed interleaved; raw rows: h5py reads alone. The data (synthetic files
in the real formats under --data, made once), the method and the columns: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import gc
import glob
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import h5py
import numpy as np
import torch

from datapipe import synthetic
from datapipe.data_loader import build_loaders
from settings.errors import OneLineParser, at_least
from settings.parse import build_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ERA5_STEPS = 120  # steps of the ERA5 training year: 119 pairs, 29 batches of 4 per epoch
SETTINGS = ("lowmem", "inmem", "device", "dali-lowmem", "dali-inmem")
GOAL_RATIO, GOAL_MAIN_SHARE = 0.9, 0.05


def ensure_data(base):
    era5 = os.path.join(base, f"era5_360x720_t{ERA5_STEPS}")
    if not os.path.isdir(os.path.join(era5, "valid")):
        synthetic.make_era5(era5, img_size=(360, 720), steps_per_year=ERA5_STEPS,
                            train_years=(2016,), valid_years=(), test_years=(), seed=0)
        # A short validation year (the loaders are built with one, never read here): its own
        # directory, as make_era5 writes statistics from training years only.
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            synthetic.make_era5(tmp, img_size=(360, 720), steps_per_year=8, train_years=(2015,),
                                valid_years=(2017,), test_years=(), seed=0)
            os.makedirs(os.path.join(era5, "valid"), exist_ok=True)
            shutil.move(os.path.join(tmp, "valid", "2017.h5"), os.path.join(era5, "valid", "2017.h5"))
    cosmo = os.path.join(base, "cosmo_256")
    if not os.path.exists(os.path.join(cosmo, "train.h5")):
        synthetic.make_cosmo(cosmo, train_size=256, val_size=64, seed=0)
    return era5, cosmo


# ----------------------------------------------------------------------------- raw reads


def raw_era5(era5, n, rng):
    """(samples/s, GB/s) of h5py reads of n whole (t, t + 1) pairs of the training year."""
    path = sorted(glob.glob(os.path.join(era5, "train", "*.h5")))[0]
    with h5py.File(path, "r") as f:
        d = f["fields"]
        t_max = d.shape[0] - 1
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            t = int(rng.integers(0, t_max))
            nbytes += d[t].nbytes + d[t + 1].nbytes
        dt = time.perf_counter() - t0
    return n / dt, nbytes / dt / 1e9


def raw_cosmo(cosmo, n, rng, s=64):
    """(samples/s, GB/s) of h5py reads of n s^3 windows of both volumes, all channels."""
    with h5py.File(os.path.join(cosmo, "train.h5"), "r") as f:
        a, b = f["Nbody"], f["Hydro"]
        L = a.shape[1]
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            i, j, k = rng.integers(0, L - s + 1, size=3)
            nbytes += a[:, i:i + s, j:j + s, k:k + s].nbytes + b[:, i:i + s, j:j + s, k:k + s].nbytes
        dt = time.perf_counter() - t0
    return n / dt, nbytes / dt / 1e9


# ----------------------------------------------------------------------------- loader cases


@dataclass
class Case:
    """One data set's loaders: a config, the overrides that point it at the data, and its raw
    read (``raw(n, rng)`` -> (samples/s, GB/s) of n samples' bytes)."""

    label: str
    yaml: str
    config: str
    overrides: dict
    raw: object
    settings: tuple = ("lowmem", "inmem", "dali-lowmem", "dali-inmem")


def loader_cases(era5, cosmo, img_size=(360, 720), era5_batch=4, crop=64, crop_batch=16,
                 unet_config="base"):
    """The ViT's ERA5 pairs and the U-Net's crops, at the README's sizes by default."""
    h, w = img_size
    return [
        Case(f"ViT ERA5 {h}x{w} pairs, batch {era5_batch}", "ViT.yaml", "base",
             {"data_root": era5, "img_size": f"[{h},{w}]", "global_batch_size": str(era5_batch),
              "limit_nsamples_val": "4"},
             lambda n, rng: raw_era5(era5, n, rng)),
        Case(f"U-Net {crop}^3 crops, batch {crop_batch}", "UNet.yaml", unet_config,
             {"data_root": cosmo, "train_file": "train.h5", "val_file": "valid.h5",
              "data_size": str(crop), "global_batch_size": str(crop_batch), "Nsamples": "4096",
              "Nsamples_val": str(crop_batch)},
             lambda n, rng: raw_cosmo(cosmo, n, rng, crop), settings=SETTINGS),
    ]


# ----------------------------------------------------------------------------- loader rows

def batches(loader, epoch=0):
    """Batches without end: epoch after epoch, from ``epoch``."""
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def measure(loader, n_batches, warmup, epoch, ahead):
    """One measurement of ``loader``: samples/s (``rate``), GB/s delivered (``gbs``) and the
    main process's CPU ms per batch (``cpu_ms``) over ``n_batches`` batches of a pass started at
    ``epoch``, after ``warmup`` batches (the prefetch queue's); then waits while the ``ahead``
    batches prefetched meanwhile are read (at the measured rate), so that they do not run beside
    the next measurement."""
    it = batches(loader, epoch)
    for _ in range(warmup):
        next(it)
    n = nbytes = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n_batches):
        x, y = next(it)
        n += x.shape[0]
        nbytes += x.nbytes + y.nbytes
        del x, y  # as the training loop: nothing holds the batch while the next one is fetched
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    it.close()
    time.sleep(min(3.0, ahead * dt / n_batches))
    return {"rate": n / dt, "gbs": nbytes / dt / 1e9, "cpu_ms": 1e3 * cpu / n_batches}


COLUMNS = ["data", "setting", "workers", "raw read, samples/s", "raw read, GB/s",
           "now, samples/s", "now, GB/s", "now / raw", "now, main CPU ms/batch",
           "now, main CPU / raw read of a batch", "load (1 min)"]


def table_header() -> str:
    return "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)


def format_row(r: dict) -> str:
    raw, now = r["raw"], r["now"]
    cells = [r["data"], r["setting"], "–" if r["setting"] == "device" else str(r["workers"]),
             f"{raw['rate']:.1f}", f"{raw['gbs']:.2f}", f"{now['rate']:.1f}", f"{now['gbs']:.2f}",
             f"{r['ratio']:.2f}", f"{now['cpu_ms']:.1f}", f"{r['main_share']:.1%}",
             "–" if r.get("load") is None else f"{r['load']:.1f}"]
    return "| " + " | ".join(cells) + " |"


def loader_rows(cases, workers_list, n_batches, rounds=3, settings=SETTINGS):
    """Measure every loader setting of ``cases`` (those in ``settings``; DALI only where installed)
    and worker count, beside the raw read, interleaved
    over ``rounds`` rounds; prints each row as it is done and returns them (dicts)."""
    rows = []
    try:
        import nvidia.dali  # noqa: F401
        have_dali = True
    except ImportError:
        have_dali = False
    for case in cases:
        for setting in case.settings:
            if setting not in settings or (setting.startswith("dali") and not have_dali):
                continue
            for w in ([0] if setting == "device" else workers_list):
                cfg = build_config(os.path.join(ROOT, "config", case.yaml), case.config,
                                   dict(case.overrides, data_loader_config=setting,
                                        num_data_workers=str(w)))
                b = cfg.global_batch_size
                loaders = build_loaders(cfg, 1, 0, b, torch.device("cpu"))
                ahead = cfg.prefetch_depth * max(1, w)  # batches a loader reads ahead
                warmup = ahead + 2
                rng = np.random.default_rng(0)
                best = {}
                for r in range(rounds):  # the two paths in a rotating order
                    for k in (("raw", "now") if r % 2 == 0 else ("now", "raw")):
                        got = (dict(zip(("rate", "gbs"), case.raw(n_batches * b, rng))) if k == "raw"
                               else measure(loaders.train, n_batches, warmup, r, ahead))
                        if k not in best or got["rate"] > best[k]["rate"]:
                            best[k] = got
                loaders.close()  # its workers end
                loaders = None  # and its memory (inmem: the data) goes now
                gc.collect()
                raw, now = best["raw"], best["now"]
                row = {"data": case.label, "setting": setting, "workers": w, "batch": b,
                       "raw": raw, "now": now,
                       "ratio": now["rate"] / raw["rate"],
                       "main_share": now["cpu_ms"] / (1e3 * b / raw["rate"]), "load": (load_averages() or [None])[0]}
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def goal_lines(rows) -> list[str]:
    """The goals of the data path, checked on ``rows``: each loader at least GOAL_RATIO of the raw
    read (lowmem and inmem, 0 and the most workers measured), the main process at most
    GOAL_MAIN_SHARE of a batch's raw read time on receiving it (rows with workers), the device
    loader faster than inmem."""
    out = []
    most = max((r["workers"] for r in rows), default=0)
    for r in rows:
        where = f"{r['data']}, {r['setting']}, {r['workers']} workers"
        if r["setting"] in ("lowmem", "inmem") and r["workers"] in (0, most):
            ok = r["ratio"] >= GOAL_RATIO
            out.append(f"- {'met' if ok else 'NOT met'}: {where}: {r['ratio']:.2f} of the raw read "
                       f"(goal {GOAL_RATIO})")
        if r["workers"] > 0 and not r["setting"].startswith("dali"):
            ok = r["main_share"] <= GOAL_MAIN_SHARE
            out.append(f"- {'met' if ok else 'NOT met'}: {where}: the main process "
                       f"{r['now']['cpu_ms']:.2f} ms CPU per batch, {r['main_share']:.1%} of a "
                       f"batch's raw read (goal {GOAL_MAIN_SHARE:.0%})")
    for d in [r for r in rows if r["setting"] == "device"]:
        inmem = [r for r in rows if r["data"] == d["data"] and r["setting"] == "inmem"]
        if inmem:
            fastest = max(inmem, key=lambda r: r["now"]["rate"])
            ok = d["now"]["rate"] > fastest["now"]["rate"]
            out.append(f"- {'met' if ok else 'NOT met'}: {d['data']}: the device loader "
                       f"{d['now']['rate']:.1f} samples/s, the fastest inmem "
                       f"{fastest['now']['rate']:.1f} ({fastest['workers']} workers): "
                       f"{d['now']['rate'] / fastest['now']['rate']:.2f}x")
    return out


def load_averages():
    """The 1, 5 and 15-minute load averages (this benchmark's processes included); None: unknown."""
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return None


def load_line() -> str:
    loads = load_averages()
    return ("load average " + " / ".join(f"{v:.2f}" for v in loads) + " (1 / 5 / 15 min)"
            if loads else "load average unknown")


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bench"),
                   help="directory of the synthetic benchmark data (made when missing)")
    p.add_argument("--only", choices=("loaders", "raw"),
                   help="run one part: the loaders or raw reads")
    p.add_argument("--workers", type=at_least(0), nargs="+", default=[0, 1, 2],
                   help="loader worker counts to measure (default: %(default)s)")
    p.add_argument("--batches", type=at_least(1), default=20,
                   help="batches timed per measurement, after those that fill the prefetch queue")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="rounds of the interleaved measurements; the best round counts")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                   help="loader settings to measure (DALI's only where it is installed)")
    p.add_argument("--models", nargs="+", choices=("vit", "unet"), default=["vit", "unet"],
                   help="whose loaders to measure: the ViT's ERA5 pairs, the U-Net's crops")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    era5, cosmo = ensure_data(args.data)
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} "
          f"threads, {load_line()}\n")
    if args.only in (None, "raw"):
        print("| raw h5py read | samples/s | MB/s |\n|---|---|---|")
        rng = np.random.default_rng(0)  # h5py reads of exactly the samples' bytes, one process
        for label, (rate, gbs) in (("ViT ERA5 360x720 pair", raw_era5(era5, 200, rng)),
                                   ("U-Net 64^3 crop pair", raw_cosmo(cosmo, 200, rng))):
            print(f"| {label} | {rate:.1f} | {gbs * 1e3:.0f} |", flush=True)
        print()
    if args.only in (None, "loaders"):
        print(table_header())
        cases = [c for c in loader_cases(era5, cosmo) if c.yaml[:-5].lower() in args.models]
        rows = loader_rows(cases, args.workers, args.batches, args.rounds, args.settings)
        print(f"\n{load_line()}\n\nGoals:\n")
        print("\n".join(goal_lines(rows)))
        print()


if __name__ == "__main__":
    main()
