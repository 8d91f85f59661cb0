"""Synthetic data at the tutorial's sizes, written in seconds, for timing runs on a GPU node
(``python -m benchmarks.gpu_runs --make-data``): ``<out>/cosmo/`` (config/UNet.yaml's
``train_file`` and ``val_file``) and ``<out>/era5/`` (a training and a validation year file and
their ``stats/``), in the formats the project's loaders read (datapipe/synthetic.py) but with
random values instead of its physical models, which take minutes at these sizes: a model trained
on them learns nothing. An ERA5 file repeats one random block of ``BLOCK`` steps, so the
statistics are exact: those of the training block.

A data set already there with the asked shapes is kept; every file is written under a temporary
name and moved into place, and only over a file this tool wrote (an HDF5 attribute says so):
another data set's files in the way are refused in one line, nothing written.
"""
from __future__ import annotations

import os
import time

import h5py
import numpy as np

from datapipe.formats import ERA5_CHANNELS
from datapipe.synthetic import YEARS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COSMO_SIDES = (256, 128)  # the first GPU run's boxes (the tutorial's crops are 64^3)
ERA5_STEPS = (200, 48)  # training and validation steps: 192 training samples of short + dt
ERA5_SIZE = (360, 720)  # the tutorial's img_size
BLOCK = 8  # steps of the repeated ERA5 block
KINDS = ("cosmo", "era5")
MARK, MARKED = "written_by", "benchmarks.gpu_data"  # the HDF5 attribute on this tool's files


def _shape_of(path: str, name: str):
    try:
        with h5py.File(path, "r") as f:
            return f[name].shape if name in f else None
    except OSError:
        return None


def _ours(path: str) -> bool:
    """Whether ``path`` is an HDF5 file this tool wrote."""
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get(MARK) == MARKED
    except OSError:
        return False


def check_free(paths, data_files) -> None:
    """Refuse (ValueError) to write ``paths`` where one exists and not every one of
    ``data_files`` (the data set's HDF5 files) that exists is this tool's: another data set's
    files (or its statistics) are never written over."""
    taken = [p for p in paths if os.path.lexists(p)]
    foreign = [p for p in data_files if os.path.lexists(p) and not _ours(p)]
    if taken and (foreign or not any(os.path.lexists(p) for p in data_files)):
        raise ValueError(f"{(foreign or taken)[0]} exists and was not written by "
                         f"benchmarks.gpu_data: choose another --out, or move it away")


def _replace(path: str, write) -> int:
    """``write(tmp)`` then move ``tmp`` onto ``path``; the file's size in bytes."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


def cosmo_paths(out_dir: str) -> tuple[str, str]:
    """config/UNet.yaml's ``train_file`` and ``val_file`` (the names its configs read) under
    ``<out_dir>/cosmo``."""
    from settings.parse import build_config

    cfg = build_config(os.path.join(ROOT, "config", "UNet.yaml"), "short", {})
    return os.path.join(out_dir, "cosmo", cfg.train_file), os.path.join(out_dir, "cosmo", cfg.val_file)


def has_cosmo(out_dir: str, sides=COSMO_SIDES) -> bool:
    return all(_shape_of(p, "Nbody") == (4, s, s, s) and _shape_of(p, "Hydro") == (5, s, s, s)
               for p, s in zip(cosmo_paths(out_dir), sides))


def make_cosmo(out_dir: str, sides=COSMO_SIDES, seed: int = 0) -> list[tuple[str, int]]:
    """The training and validation boxes (sides ``sides``) under ``<out_dir>/cosmo``:
    [(path, bytes)]."""
    rng = np.random.default_rng(seed)
    written = []
    for path, side in zip(cosmo_paths(out_dir), sides):
        side = int(side)
        if side < 2:
            raise ValueError(f"a cosmology box needs a side of at least 2 voxels, got {side}")
        os.makedirs(os.path.dirname(path), exist_ok=True)

        def write(tmp, side=side):
            with h5py.File(tmp, "w") as f:
                f.attrs[MARK] = MARKED
                nbody = f.create_dataset("Nbody", (4, side, side, side), np.float32)
                hydro = f.create_dataset("Hydro", (5, side, side, side), np.float32)
                for c in range(4):
                    nbody[c] = 0.5 * rng.standard_normal((side,) * 3, dtype=np.float32)
                for c in range(5):
                    hydro[c] = 1.9 * rng.random((side,) * 3, dtype=np.float32) - 0.95
        written.append((path, _replace(path, write)))
    return written


def era5_paths(out_dir: str) -> tuple[str, str]:
    root = os.path.join(out_dir, "era5")
    return (os.path.join(root, "train", f"{YEARS['train'][0]}.h5"),
            os.path.join(root, "valid", f"{YEARS['valid'][0]}.h5"))


def has_era5(out_dir: str, steps=ERA5_STEPS, img_size=ERA5_SIZE) -> bool:
    h, w = img_size
    shapes = [(int(t), len(ERA5_CHANNELS), int(h), int(w)) for t in steps]
    stats = [os.path.join(out_dir, "era5", "stats", f"global_{n}.npy") for n in ("means", "stds")]
    return (all(_shape_of(p, "fields") == s for p, s in zip(era5_paths(out_dir), shapes))
            and all(os.path.exists(p) for p in stats))


def make_era5(out_dir: str, steps=ERA5_STEPS, img_size=ERA5_SIZE, seed: int = 0,
              block_steps: int = BLOCK) -> list[tuple[str, int]]:
    """One training and one validation year file (``steps`` steps each) and the statistics of
    the training values under ``<out_dir>/era5``: [(path, bytes)]."""
    h, w = (int(v) for v in img_size)
    if h < 2 or w < 2 or min(int(t) for t in steps) < 2:
        raise ValueError(f"ERA5 files need at least 2 steps of 2 x 2 points, got steps {steps}, "
                         f"img_size {img_size}")
    rng = np.random.default_rng(seed)
    nc = len(ERA5_CHANNELS)
    c = np.arange(nc, dtype=np.float32)[:, None, None]
    written, train_block = [], None
    for path, t in zip(era5_paths(out_dir), steps):
        t = int(t)
        block = rng.standard_normal((min(block_steps, t), nc, h, w), dtype=np.float32)
        block *= 1.0 + c  # channel c: normal with mean 10 c and std 1 + c
        block += 10.0 * c
        train_block = block if train_block is None else train_block
        os.makedirs(os.path.dirname(path), exist_ok=True)

        def write(tmp, t=t, block=block):
            with h5py.File(tmp, "w") as f:
                f.attrs[MARK] = MARKED
                fields = f.create_dataset("fields", (t, nc, h, w), np.float32)
                for start in range(0, t, len(block)):
                    stop = min(t, start + len(block))
                    fields[start:stop] = block[: stop - start]
        written.append((path, _replace(path, write)))
    stats_dir = os.path.join(out_dir, "era5", "stats")
    os.makedirs(stats_dir, exist_ok=True)
    # The training file repeats its block whole or in part; the block's statistics stand for it.
    values = train_block.astype(np.float64)
    stats = {"global_means": values.mean(axis=(0, 2, 3)).reshape(1, nc, 1, 1),
             "global_stds": values.std(axis=(0, 2, 3)).reshape(1, nc, 1, 1),
             "time_means": values.mean(axis=0)[None]}
    for name, array in stats.items():
        path = os.path.join(stats_dir, f"{name}.npy")

        def save(tmp, array=array):
            with open(tmp, "wb") as f:
                np.save(f, array.astype(np.float32))
        written.append((path, _replace(path, save)))
    return written


def estimate_s(kinds=KINDS, cosmo=COSMO_SIDES, era5_steps=ERA5_STEPS,
               era5_size=ERA5_SIZE) -> float:
    """Seconds to make the data on a GPU node (the first GPU run: a 256^3 box in 1 s, 400 steps
    of 360 x 720 in 8 s): about 1 GB/s."""
    nbytes = 0
    if "cosmo" in kinds:
        nbytes += 9 * 4 * sum(int(s) ** 3 for s in cosmo)
    if "era5" in kinds:
        nbytes += len(ERA5_CHANNELS) * 4 * int(era5_size[0]) * int(era5_size[1]) * sum(
            int(t) for t in era5_steps)
    return 1.0 + nbytes / 1e9


def make(out_dir: str, kinds=KINDS, cosmo=COSMO_SIDES, era5_steps=ERA5_STEPS,
         era5_size=ERA5_SIZE, log=print) -> float:
    """Make what ``kinds`` asks for under ``out_dir`` (kept when already there); seconds taken."""
    t0 = time.perf_counter()
    for kind in kinds:
        t1 = time.perf_counter()
        if kind == "cosmo":
            if has_cosmo(out_dir, cosmo):
                log(f"data: cosmology boxes {cosmo} already in {out_dir}/cosmo: kept")
                continue
            check_free(cosmo_paths(out_dir), cosmo_paths(out_dir))
            written = make_cosmo(out_dir, cosmo)
        else:
            if has_era5(out_dir, era5_steps, era5_size):
                log(f"data: ERA5 files of {era5_steps} steps already in {out_dir}/era5: kept")
                continue
            stats = [os.path.join(out_dir, "era5", "stats", f"{n}.npy")
                     for n in ("global_means", "global_stds", "time_means")]
            check_free([*era5_paths(out_dir), *stats], era5_paths(out_dir))
            written = make_era5(out_dir, era5_steps, era5_size)
        total = sum(n for _, n in written)
        log(f"data: {kind} written in {time.perf_counter() - t1:.1f} s, {total / 1e9:.2f} GB: "
            + ", ".join(os.path.relpath(p, out_dir) for p, _ in written))
    return time.perf_counter() - t0
