"""ERA5 input/target pairs read from per-year HDF5 files, as the tutorial data is stored.

``<dir>/<year>.h5`` holds ``fields`` shaped (T, C, H, W). A sample is the state at step t and the
state at t + dt of the same year, cropped to ``img_size``, as stored (float32, not normalised:
``ERA5Task.device_batch`` normalises with the global means and stds on the device, the first
operation of the step). Every valid pair (t, t + dt), t in [0, T - dt), of every year is one
index, so each is drawn with the same probability (no folding of indices onto others).

``rows=(start, stop)`` limits a dataset to that band of image rows of the cropped image: a
model-parallel rank that only uses its band (``ParallelViT.image_rows()``) reads
``fields[t, :C, start:stop, :W]`` as an HDF5 hyperslab instead of the whole sample, and in
memory mode holds only those rows. Samples are then ``(C, stop - start, W)`` and equal rows
``start:stop`` of the full sample.

Batches are read whole (``read_batch``): each field straight from the file (or the in-memory
copy) into its slot of the caller's batch buffer, no per-sample arrays, and checked for
non-finite values once per batch.
"""
from __future__ import annotations

import glob
import operator
import os

import h5py
import numpy as np

from utils.batch_dataset import (BatchReadDataset, check_stored_dtype, finite_sums,
                                  read_float32)
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


class ERA5Dataset(BatchReadDataset):
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
        load_stats(data_root, max(n_in, n_out))  # refused here, before training, if missing
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
        # In memory: which steps are finite as inputs (first n_in channels) and as targets,
        # found once here, so that batches need no check of their own.
        self._finite = None if self._arrays is None else [
            (_finite_steps(a[:, :n_in]), _finite_steps(a[:, :n_out])) for a in self._arrays]

    @property
    def sample_shapes(self):
        """Shapes of one input and one target: (n_in, rows, W) and (n_out, rows, W)."""
        h, w = self.rows[1] - self.rows[0], self.img_size[1]
        return (self.n_in, h, w), (self.n_out, h, w)

    def _check_file(self, path) -> int:
        h, w = self.img_size
        try:
            with h5py.File(path, "r") as f:
                if "fields" not in f:
                    raise DataError(f"{path} has no dataset 'fields' (found: {list(f.keys())})")
                shape = f["fields"].shape
                check_stored_dtype(path, "fields", f["fields"])
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
            return read_float32(f["fields"], np.s_[:, : max(self.n_in, self.n_out), start:stop, :w])

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

    def read_batch(self, keys, x: np.ndarray, y: np.ndarray):
        """Samples ``keys`` (indices, or (epoch, index) pairs) into ``x`` (B, n_in, rows, W) and
        ``y`` (B, n_out, rows, W), float32 C-contiguous arrays the caller owns."""
        w = self.img_size[1]
        band = slice(*self.rows)
        where = [self.locate(key[1] if isinstance(key, tuple) else key) for key in keys]
        for j, (k, t) in enumerate(where):
            fields = self._fields(k)
            if self._arrays is not None:  # the band is all there is: one copy into the slot
                ok_in, ok_out = self._finite[k]
                if not (ok_in[t] and ok_out[t + self.dt]):
                    self._refuse(k, t)
                np.copyto(x[j], fields[t, : self.n_in])
                np.copyto(y[j], fields[t + self.dt, : self.n_out])
            else:  # an HDF5 hyperslab (only the band's rows) read into the slot, no copy after
                fields.read_direct(x[j], np.s_[t, : self.n_in, band, :w])
                fields.read_direct(y[j], np.s_[t + self.dt, : self.n_out, band, :w])
        # One reduction over the batch: a NaN or infinity anywhere makes the sum non-finite.
        # Only then are the samples looked at one by one (a huge finite sum may overflow too).
        if self._arrays is None and not finite_sums(x, y):
            for j, (k, t) in enumerate(where):
                if not (np.isfinite(x[j]).all() and np.isfinite(y[j]).all()):
                    self._refuse(k, t)

    def _refuse(self, k, t):
        raise DataError(f"non-finite values in {self.files[k]} at step {t} or {t + self.dt} "
                        f"(rows {self.rows[0]}:{self.rows[1]}): repair the file or remove it "
                        f"from {self.directory}")


def _finite_steps(a: np.ndarray) -> np.ndarray:
    """(T,) bool: step t of ``a`` (T, ...) holds only finite values."""
    ok = np.isfinite(a.sum(axis=tuple(range(1, a.ndim)), dtype=np.float64))
    for t in np.flatnonzero(~ok):  # a sum can overflow where every value is finite
        ok[t] = np.isfinite(a[t]).all()
    return ok
