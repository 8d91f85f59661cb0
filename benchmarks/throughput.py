"""Loader and training throughput on this machine, beside the raw HDF5 read rate (the limit).

    python -m benchmarks.throughput                 # everything, prints Markdown tables
    python -m benchmarks.throughput --only loaders  # or: raw, train

Data: synthetic files in the real formats under --data (made once): ERA5 at the tutorial's
360x720 and a 256^3 cosmology box with 64^3 crops, plus the quickstart sizes. Loader rows time
whole batches through the project's DataLoader (workers, batch assembly, rotations), each
beside the raw rate of the same run; "before" rows time the per-sample path the loaders had
before (a sample read into its own array, normalised on the host for ERA5, rotated in two
passes for the cosmology crops, stacked by the collate function). Raw rows read the same bytes
with h5py and nothing else. Training rows time optimizer steps of the quickstart and the
tutorial's reference model sizes, on cached data (compute only) and through the loader.
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
from utils.cosmo_data import CosmoCropDataset  # noqa: E402
from utils.data_loader import BatchReader  # noqa: E402
from utils.era5_data import ERA5Dataset, load_stats  # noqa: E402
from utils.rotations import ROTATIONS  # noqa: E402
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


class PerSampleERA5(ERA5Dataset):
    """The ERA5 sample as the loader read it before: its own arrays, normalised in place on the
    host, checked with one reduction; batches stacked by the default collate function."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        means, stds = load_stats(kw["data_root"], max(self.n_in, self.n_out))
        self.means, self.inv_stds = means, (1.0 / stds).astype(np.float32)

    def __getitem__(self, key):
        k, t = self.locate(key[1] if isinstance(key, tuple) else key)
        w, fields = self.img_size[1], self._fields(k)
        band = slice(*self.rows) if self._arrays is None else slice(None)
        x = np.array(fields[t, : self.n_in, band, :w], dtype=np.float32, copy=self._arrays is not None)
        y = np.array(fields[t + self.dt, : self.n_out, band, :w], dtype=np.float32,
                     copy=self._arrays is not None)
        x -= self.means[: self.n_in]
        x *= self.inv_stds[: self.n_in]
        y -= self.means[: self.n_out]
        y *= self.inv_stds[: self.n_out]
        assert np.isfinite(x.sum()) and np.isfinite(y.sum())
        return torch.from_numpy(x), torch.from_numpy(y)


def rotate_two_passes(x, rot, vector_channels):
    """The rotation as it was: a contiguous copy of the turned grid, then the vector channels
    copied out and written back permuted and signed."""
    perm, sign = rot
    y = np.transpose(x, (0, 1 + perm[0], 1 + perm[1], 1 + perm[2]))
    flip_axes = tuple(1 + i for i in range(3) if sign[i] < 0)
    if flip_axes:
        y = np.flip(y, axis=flip_axes)
    y = np.ascontiguousarray(y)
    if len(vector_channels):
        vc = list(vector_channels)
        comps = y[vc].copy()
        for i in range(3):
            y[vc[i]] = sign[i] * comps[perm[i]]
    return y


class PerSampleCosmo(CosmoCropDataset):
    """The crop as the loader read it before: its own arrays, checked element by element (from
    the file), rotated in two passes; batches stacked by the default collate function."""

    def __getitem__(self, key):
        epoch, i = key if isinstance(key, tuple) else (0, key)
        (a, b, c), rot = self.window(epoch if self.augment else 0, i)
        s = self.size
        nbody, hydro = self._volumes()
        x = np.asarray(nbody[: self.n_in, a:a + s, b:b + s, c:c + s], dtype=np.float32)
        y = np.asarray(hydro[: self.n_out, a:a + s, b:b + s, c:c + s], dtype=np.float32)
        assert self._arrays is not None or (np.isfinite(x).all() and np.isfinite(y).all())
        if rot:
            x = rotate_two_passes(x, ROTATIONS[rot], self.in_vec)
            y = rotate_two_passes(y, ROTATIONS[rot], self.out_vec)
        return torch.from_numpy(x), torch.from_numpy(y)


def per_sample_loader(ld, workers):
    """The loader ``ld`` on the per-sample path of before: same sampler, same samples."""
    ds = ld.dataset.dataset if isinstance(ld.dataset, BatchReader) else ld.dataset
    if isinstance(ds, ERA5Dataset):
        old = PerSampleERA5(ds.directory, data_root=os.path.dirname(ds.directory.rstrip("/")),
                            img_size=ds.img_size, dt=ds.dt, n_in=ds.n_in, n_out=ds.n_out,
                            inmem=ds._arrays is not None, rows=ds.rows)
        old.index = ds.index
    else:
        old = PerSampleCosmo(ds.path, ds.size, ds.nsamples, ds.n_in, ds.n_out, ds.in_vec,
                             ds.out_vec, ds.augment, ds.seed, inmem=ds._arrays is not None)
    return torch.utils.data.DataLoader(old, batch_size=ld.batch_size, sampler=ld.sampler,
                                       num_workers=workers, persistent_workers=workers > 0)


LOADER_CASES = [
    ("ViT ERA5 360x720 pairs, batch 4", "ViT.yaml", "ViT ERA5 360x720 pair"),
    ("U-Net 64^3 crops of 256^3, batch 16", "UNet.yaml", "U-Net 64^3 crop pair"),
]


def loader_rows(era5, cosmo, workers_list, n_batches, before=True):
    """Samples/s of each loader and its ratio to the raw read rate of the same bytes, timed in
    the same rounds (the machine's load changes between minutes, not within a round); with
    ``before``, the per-sample path beside it."""
    rows = []
    overrides = {"ViT.yaml": {"data_root": era5, "global_batch_size": "4"},
                 "UNet.yaml": {"data_root": cosmo, "train_file": "train.h5", "val_file": "valid.h5",
                               "global_batch_size": "16", "Nsamples": "4096"}}
    rng = np.random.default_rng(0)
    for label, yaml_name, raw_label in LOADER_CASES:
        root = era5 if yaml_name == "ViT.yaml" else cosmo
        for setting in ("lowmem", "inmem"):
            for w in workers_list:
                cfg = build_config(os.path.join(ROOT, "config", yaml_name), "base",
                                   dict(overrides[yaml_name], data_loader_config=setting,
                                        num_data_workers=str(w)))
                ld = build_loaders(cfg, 1, 0, cfg.global_batch_size, torch.device("cpu")).train
                n = n_batches // 2 * cfg.global_batch_size
                paths = {"raw": lambda: RAW[raw_label](root, n, rng)[0]}
                if before:
                    old = per_sample_loader(ld, w)
                    paths["before"] = lambda: timed_batches(old, n_batches // 2)
                paths["now"] = lambda: timed_batches(ld, n_batches // 2)
                rate = {k: 0.0 for k in paths}
                for _ in range(2):  # two rounds, alternating the paths; the better one counts
                    for k, run in paths.items():
                        rate[k] = max(rate[k], run())
                ratio = {k: v / rate["raw"] for k, v in rate.items()}
                rows.append((label, setting, w, rate, ratio))
                old = f" {rate['before']:.1f} | {ratio['before']:.2f} |" if before else ""
                print(f"| {label} | {setting} | {w} | {rate['raw']:.1f} |{old} {rate['now']:.1f} | "
                      f"{ratio['now']:.2f} |", flush=True)
    return rows


def raw_era5(era5, n, rng):
    """(samples/s, MB/s) of h5py reads of n whole (t, t + 1) pairs of one year file."""
    with h5py.File(os.path.join(era5, "train", "2016.h5"), "r") as f:
        d = f["fields"]
        t_max = d.shape[0] - 1
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            t = int(rng.integers(0, t_max))
            nbytes += d[t].nbytes + d[t + 1].nbytes
        dt = time.perf_counter() - t0
    return n / dt, nbytes / dt / 1e6


def raw_cosmo(cosmo, n, rng, s=64):
    """(samples/s, MB/s) of h5py reads of n s^3 windows of both volumes, all channels."""
    with h5py.File(os.path.join(cosmo, "train.h5"), "r") as f:
        a, b = f["Nbody"], f["Hydro"]
        L = a.shape[1]
        t0 = time.perf_counter()
        nbytes = 0
        for _ in range(n):
            i, j, k = rng.integers(0, L - s + 1, size=3)
            nbytes += a[:, i:i + s, j:j + s, k:k + s].nbytes + b[:, i:i + s, j:j + s, k:k + s].nbytes
        dt = time.perf_counter() - t0
    return n / dt, nbytes / dt / 1e6


RAW = {"ViT ERA5 360x720 pair": raw_era5, "U-Net 64^3 crop pair": raw_cosmo}


def raw_rows(era5, cosmo, n):
    """h5py reads of exactly the samples' bytes, one process, no decoding or augmentation."""
    rng = np.random.default_rng(0)
    out = {"ViT ERA5 360x720 pair": raw_era5(era5, n, rng),
           "U-Net 64^3 crop pair": raw_cosmo(cosmo, n, rng)}
    for label, (rate, mbs) in out.items():
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
        x, y = task.device_batch(x, y)  # as the engine's first operation of the step
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bench"),
                   help="directory of the synthetic benchmark data (made when missing)")
    p.add_argument("--only", choices=("loaders", "raw", "train"),
                   help="run one part: the loaders, raw reads, or training steps")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2],
                   help="loader worker counts to measure (default: %(default)s)")
    p.add_argument("--batches", type=int, default=20, help="batches per measurement")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    era5, cosmo = ensure_data(args.data)
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads\n")
    if args.only in (None, "raw"):
        print("| raw h5py read | samples/s | MB/s |\n|---|---|---|")
        raw_rows(era5, cosmo, 200)
        print()
    if args.only in (None, "loaders"):
        print("| loader | setting | workers | raw read, samples/s | before, samples/s | before, "
              "ratio to raw | now, samples/s | now, ratio to raw |\n|---|---|---|---|---|---|---|---|")
        loader_rows(era5, cosmo, args.workers, args.batches)
        print()
    if args.only in (None, "train"):
        print("| training step | cached data, samples/s | through the loader, samples/s |\n|---|---|---|")
        train_rows(era5, cosmo, args.data)


if __name__ == "__main__":
    main()
