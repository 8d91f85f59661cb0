"""Loader and training throughput on this machine, beside the raw HDF5 read rate (the limit).

    python -m benchmarks.throughput                 # everything, prints Markdown tables
    python -m benchmarks.throughput --only loaders  # or: raw, train

Data: synthetic files in the real formats under --data (made once): ERA5 at 180x360 (a quarter
of the tutorial's 360x720 area) and a 256^3 cosmology box with 64^3 crops, plus the quickstart
sizes. Loader rows time whole batches through the project's DataLoader (workers, normalisation,
rotations); raw rows read the same bytes with h5py and nothing else. Training rows time
optimizer steps of the quickstart and the tutorial's reference model sizes, on cached data
(compute only) and through the loader.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import synthetic  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.data_loader import build_loaders  # noqa: E402
from utils.era5_data import ERA5Dataset  # noqa: E402
from utils.tasks import make_task  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_data(base):
    era5 = os.path.join(base, "era5_360x720")
    if not os.path.isdir(os.path.join(era5, "train")):
        synthetic.make_era5(era5, img_size=(360, 720), steps_per_year=40, train_years=(2016,),
                            valid_years=(2017,), test_years=(), seed=0)
    cosmo = os.path.join(base, "cosmo_256")
    if not os.path.exists(os.path.join(cosmo, "train.h5")):
        synthetic.make_cosmo(cosmo, train_size=256, val_size=64, seed=0)
    return era5, cosmo


def batches(loader):
    """Batches without end: epoch after epoch."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def timed_batches(loader, n_batches, warmup=2):
    it = batches(loader)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    n = 0
    for _ in range(n_batches):
        x, _ = next(it)
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def loader_rows(era5, cosmo, workers_list, n_batches):
    rows = []
    cases = [
        ("ViT ERA5 360x720 pairs, batch 4", "ViT.yaml",
         {"data_root": era5, "global_batch_size": "4"}),
        ("U-Net 64^3 crops of 256^3, batch 16", "UNet.yaml",
         {"data_root": cosmo, "train_file": "train.h5", "val_file": "valid.h5",
          "global_batch_size": "16", "Nsamples": "4096"}),
    ]
    for label, yaml_name, ov in cases:
        for setting in ("lowmem", "inmem"):
            for w in workers_list:
                cfg = build_config(os.path.join(ROOT, "config", yaml_name), "base",
                                   dict(ov, data_loader_config=setting, num_data_workers=str(w)))
                ld = build_loaders(cfg, 1, 0, cfg.global_batch_size, torch.device("cpu"))
                rate = timed_batches(ld.train, n_batches)
                rows.append((label, setting, w, rate))
                print(f"| {label} | {setting} | {w} | {rate:.1f} |", flush=True)
    return rows


def raw_rows(era5, cosmo, n):
    """h5py reads of exactly the samples' bytes, one process, no decoding or augmentation."""
    rng = np.random.default_rng(0)
    out = []
    path = os.path.join(era5, "train", "2016.h5")
    with h5py.File(path, "r") as f:
        d = f["fields"]
        t_max = d.shape[0] - 1
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            t = int(rng.integers(0, t_max))
            nbytes += d[t].nbytes + d[t + 1].nbytes
        dt = time.perf_counter() - t0
    out.append(("ViT ERA5 360x720 pair", n / dt, nbytes / dt / 1e6))
    with h5py.File(os.path.join(cosmo, "train.h5"), "r") as f:
        a, b = f["Nbody"], f["Hydro"]
        L, s = a.shape[1], 64
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            i, j, k = rng.integers(0, L - s + 1, size=3)
            nbytes += a[:, i:i + s, j:j + s, k:k + s].nbytes + b[:, i:i + s, j:j + s, k:k + s].nbytes
        dt = time.perf_counter() - t0
    out.append(("U-Net 64^3 crop pair", n / dt, nbytes / dt / 1e6))
    for label, rate, mbs in out:
        print(f"| {label} | {rate:.1f} | {mbs:.0f} |", flush=True)
    return out


def train_rate(yaml_name, name, overrides, steps, cached=True):
    """Samples/s of full optimizer steps (forward, backward, Adam) on one process."""
    cfg = build_config(os.path.join(ROOT, "config", yaml_name), name,
                       dict(overrides, data_loader_config="synthetic" if cached else "lowmem"))
    task = make_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ld = build_loaders(cfg, 1, 0, cfg.global_batch_size, torch.device("cpu"))
    it = batches(ld.train)
    x, y = next(it)

    def step(x, y):
        loss = task.loss(model(x), y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(x, y)  # warm-up: allocations, first-touch
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        step(x, y)
    return steps * cfg.global_batch_size / (time.perf_counter() - t0)


def train_rows(era5, cosmo, base):
    qs_era5 = os.path.join(base, "era5_quickstart")
    qs_cosmo = os.path.join(base, "cosmo_quickstart")
    if not os.path.isdir(os.path.join(qs_era5, "train")):
        synthetic.make_era5(qs_era5, seed=0)
    if not os.path.exists(os.path.join(qs_cosmo, "train.h5")):
        synthetic.make_cosmo(qs_cosmo, seed=0)
    cases = [
        ("ViT quickstart (32x64, embed 128, depth 4), batch 16", "ViT.yaml", "quickstart",
         {"data_root": qs_era5}, 20),
        ("ViT reference (360x720, patch 8, embed 384, depth 12), batch 2", "ViT.yaml", "base",
         {"data_root": era5, "global_batch_size": "2"}, 3),
        ("U-Net quickstart (32^3, width 8, 5 levels), batch 8", "UNet.yaml", "quickstart",
         {"data_root": qs_cosmo}, 10),
        ("U-Net reference (64^3, width 64, 6 levels), batch 4", "UNet.yaml", "base",
         {"data_root": cosmo, "train_file": "train.h5", "val_file": "valid.h5",
          "global_batch_size": "4", "Nsamples": "64"}, 3),
    ]
    rows = []
    for label, yaml_name, name, ov, steps in cases:
        cached = train_rate(yaml_name, name, ov, steps, cached=True)
        loaded = train_rate(yaml_name, name, ov, steps, cached=False)
        rows.append((label, cached, loaded))
        print(f"| {label} | {cached:.2f} | {loaded:.2f} |", flush=True)
    return rows


class AllocatingERA5(ERA5Dataset):
    """The ERA5 sample as first written: (x - mean) / std with fresh temporaries and an
    elementwise finiteness check; kept here only as the 'before' of the comparison."""

    def __getitem__(self, i):
        k, t = self.locate(i)
        h, w = self.img_size
        fields = self._fields(k)
        x = np.asarray(fields[t, : self.n_in, :h, :w], dtype=np.float32)
        y = np.asarray(fields[t + self.dt, : self.n_out, :h, :w], dtype=np.float32)
        assert np.isfinite(x).all() and np.isfinite(y).all()
        x = (x - self.means[: self.n_in]) / self.stds[: self.n_in]
        y = (y - self.means[: self.n_out]) / self.stds[: self.n_out]
        return torch.from_numpy(x), torch.from_numpy(y)


def sample_rows(era5, n=40, rounds=3):
    """ms per ERA5 360x720 sample, before and after in-place normalisation, interleaved."""
    kw = dict(data_root=era5, img_size=(360, 720))
    cases = {"allocating (before)": AllocatingERA5(os.path.join(era5, "train"), **kw),
             "in place (now)": ERA5Dataset(os.path.join(era5, "train"), **kw)}
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for label, ds in cases.items():
            t0 = time.perf_counter()
            for i in range(n):
                ds[i % len(ds)]
            times[label].append((time.perf_counter() - t0) / n * 1e3)
    best = {k: min(v) for k, v in times.items()}
    for label, ms in best.items():
        print(f"| ERA5 360x720 sample, {label} | {ms:.1f} | {1e3 / ms:.1f} |", flush=True)
    before, now = best.values()
    print(f"\nspeed-up: {before / now:.2f}x")
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bench"))
    p.add_argument("--only", choices=("loaders", "raw", "sample", "train"))
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--batches", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    era5, cosmo = ensure_data(args.data)
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads\n")
    if args.only in (None, "raw"):
        print("| raw h5py read | samples/s | MB/s |\n|---|---|---|")
        raw_rows(era5, cosmo, 200)
        print()
    if args.only in (None, "sample"):
        print("| one sample through the dataset | ms | samples/s |\n|---|---|---|")
        sample_rows(era5)
        print()
    if args.only in (None, "loaders"):
        print("| loader | setting | workers | samples/s |\n|---|---|---|---|")
        loader_rows(era5, cosmo, args.workers, args.batches)
        print()
    if args.only in (None, "train"):
        print("| training step | cached data, samples/s | through the loader, samples/s |\n|---|---|---|")
        train_rows(era5, cosmo, args.data)


if __name__ == "__main__":
    main()
