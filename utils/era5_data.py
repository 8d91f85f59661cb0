"""ERA5 input/target pairs read from per-year HDF5 files, as the tutorial data is stored.

``<dir>/<year>.h5`` holds ``fields`` shaped (T, C, H, W). A sample is the state at step t and the
state at t + dt of the same year, normalised with the global means and stds and cropped to
``img_size``. Every valid pair (t, t + dt), t in [0, T - dt), of every year is one index, so each
is drawn with the same probability (no folding of indices onto others).

``rows=(start, stop)`` limits a dataset to that band of image rows of the cropped image: a
model-parallel rank that only uses its band (``ParallelViT.image_rows()``) reads
``fields[t, :C, start:stop, :W]`` as an HDF5 hyperslab instead of the whole sample, and in
memory mode holds only those rows. Samples are then ``(C, stop - start, W)`` and equal rows
``start:stop`` of the full sample (the normalisation is per channel).
"""
from __future__ import annotations

import glob
import operator
import os

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from utils.errors import DataError


def load_stats(root: str, n_channels: int):
    """Global means and stds, (1, C, 1, 1) on disk, as (C, 1, 1) float32 arrays."""
    out = []
    for name in ("global_means", "global_stds"):
        path = os.path.join(root, "stats", f"{name}.npy")
        try:
            a = np.load(path)
        except FileNotFoundError:
            raise DataError(f"{path} not found: the ERA5 stats must be in <data_root>/stats/ "
                            f"(make them with: python -m utils.synthetic era5 --out DIR)") from None
        except ValueError as e:
            raise DataError(f"{path} is not a valid .npy file ({e})") from None
        if a.ndim != 4 or a.shape[0] != 1 or a.shape[2:] != (1, 1) or a.shape[1] < n_channels:
            raise DataError(f"{path} has shape {a.shape}; expected (1, C, 1, 1) with C >= "
                            f"{n_channels}")
        out.append(a[0, :n_channels].astype(np.float32))
    means, stds = out
    if not np.all(np.isfinite(means)) or not np.all(np.isfinite(stds)) or np.any(stds <= 0):
        raise DataError(f"{root}/stats holds non-finite means or non-positive stds")
    return means, stds


def check_rows(rows, height: int) -> tuple[int, int]:
    """``rows`` as ``(start, stop)`` with ``0 <= start < stop <= height``; ``None``: all rows."""
    if rows is None:
        return 0, height
    try:
        start, stop = (operator.index(r) for r in rows)  # integers only: 3.5 is refused
    except (TypeError, ValueError):
        raise ValueError(f"rows={rows!r} must be a (start, stop) pair of image rows") from None
    if not 0 <= start < stop <= height:
        raise ValueError(f"rows={rows!r} is not a band of the {height} image rows: choose "
                         f"0 <= start < stop <= {height} (img_size[0])")
    return start, stop


class ERA5Dataset(Dataset):
    def __init__(self, directory, data_root, img_size, dt=1, n_in=20, n_out=20,
                 limit_nsamples=None, inmem=False, rows=None):
        self.directory = directory
        self.img_size = tuple(img_size)
        self.rows = check_rows(rows, self.img_size[0])  # the band of image rows a sample holds
        self.dt, self.n_in, self.n_out = dt, n_in, n_out
        self.files = sorted(glob.glob(os.path.join(directory, "*.h5")))
        if not self.files:
            raise DataError(f"no ERA5 year files (*.h5) in {directory}: set --data_root to the "
                            f"directory holding train/, valid/ and stats/ (or the ERA5_DATA_ROOT "
                            f"environment variable), or generate synthetic data with "
                            f"python -m utils.synthetic era5 --out DIR")
        self.means, self.stds = load_stats(data_root, max(n_in, n_out))
        self.inv_stds = (1.0 / self.stds).astype(np.float32)
        self.pairs_per_file = [self._check_file(f) for f in self.files]
        self.offsets = np.cumsum([0] + self.pairs_per_file)
        total = int(self.offsets[-1])
        if limit_nsamples is not None and limit_nsamples < total:
            # An even spread over all years, not the first N pairs of the first year.
            self.index = np.unique(np.linspace(0, total - 1, limit_nsamples).round().astype(np.int64))
        else:
            self.index = np.arange(total, dtype=np.int64)
        self._handles = {}
        self._pid = None
        self._arrays = [self._read_all(f) for f in self.files] if inmem else None

    def _check_file(self, path) -> int:
        h, w = self.img_size
        try:
            with h5py.File(path, "r") as f:
                if "fields" not in f:
                    raise DataError(f"{path} has no dataset 'fields' (found: {list(f.keys())})")
                shape = f["fields"].shape
        except OSError as e:
            raise DataError(f"{path} is not a readable HDF5 file ({e}): replace or remove it") from None
        if len(shape) != 4:
            raise DataError(f"{path}: 'fields' has shape {shape}; expected (T, C, H, W)")
        t, c, fh, fw = shape
        need_c = max(self.n_in, self.n_out)
        if c < need_c or fh < h or fw < w:
            raise DataError(f"{path}: 'fields' {shape} is smaller than the model needs "
                            f"(C >= {need_c}, H >= {h}, W >= {w}): check img_size and channels")
        if t <= self.dt:
            raise DataError(f"{path} holds {t} steps, not more than dt={self.dt}")
        return t - self.dt

    def _read_all(self, path):
        (start, stop), w = self.rows, self.img_size[1]
        with h5py.File(path, "r") as f:
            return f["fields"][:, :, start:stop, :w]

    def _fields(self, k):
        """Year file k: the in-memory band (rows already selected) or the HDF5 dataset."""
        if self._arrays is not None:
            return self._arrays[k]
        # Opened lazily and once per process: an h5py handle must not cross a fork.
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            self._handles[k] = h5py.File(self.files[k], "r")["fields"]
        return self._handles[k]

    def __len__(self):
        return len(self.index)

    def locate(self, i: int):
        """(file number, time step) of sample i."""
        j = int(self.index[i])
        k = int(np.searchsorted(self.offsets, j, side="right") - 1)
        return k, j - int(self.offsets[k])

    def __getitem__(self, key):
        i = key[1] if isinstance(key, tuple) else key
        k, t = self.locate(i)
        w = self.img_size[1]
        fields = self._fields(k)
        # On disk a hyperslab: h5py reads only the band's rows. In memory the band is all there is.
        band = slice(*self.rows) if self._arrays is None else slice(None)
        x = np.array(fields[t, : self.n_in, band, :w], dtype=np.float32, copy=self._arrays is not None)
        y = np.array(fields[t + self.dt, : self.n_out, band, :w], dtype=np.float32,
                     copy=self._arrays is not None)  # in memory: copy, the data stays unchanged
        # In place, with the reciprocal precomputed: no temporaries the size of a sample.
        x -= self.means[: self.n_in]
        x *= self.inv_stds[: self.n_in]
        y -= self.means[: self.n_out]
        y *= self.inv_stds[: self.n_out]
        # One reduction each: a NaN or infinity anywhere makes the sum non-finite (normalised
        # values are O(1), so a finite sample cannot overflow it).
        if not (np.isfinite(x.sum()) and np.isfinite(y.sum())):
            raise DataError(f"non-finite values in {self.files[k]} at step {t} or {t + self.dt} "
                            f"(rows {self.rows[0]}:{self.rows[1]}): repair the file or remove it "
                            f"from {self.directory}")
        return torch.from_numpy(x), torch.from_numpy(y)
