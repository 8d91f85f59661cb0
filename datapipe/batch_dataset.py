"""Datasets that read whole batches straight into one buffer.

A subclass says the shapes of one sample (``sample_shapes``: input and target, without the batch
dimension) and fills preallocated float32 batch arrays in ``read_batch(keys, x, y)``; the loader
(``datapipe.batch_pool.BatchLoader``) hands it a batch's keys at once. One sample is a batch of one.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from settings.errors import DataError

# Stored types read as float32 without loss: HDF5 converts them while reading into the batch.
# float64 values beyond float32's range become infinite and are refused by the finite check.
EXACT_IN_FLOAT32 = ("f2", "f4", "f8", "i1", "u1", "i2", "u2")


class BatchReadDataset(Dataset):
    sample_shapes: tuple  # ((C_in, ...), (C_out, ...)) of one sample

    def read_batch(self, keys, x: np.ndarray, y: np.ndarray):
        """Fill ``x[j]``, ``y[j]`` with the sample of ``keys[j]``."""
        raise NotImplementedError

    def read(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """The samples ``keys`` in new arrays: inputs (B, *sx) and targets (B, *sy)."""
        sx, sy = self.sample_shapes
        x, y = np.empty((len(keys), *sx), np.float32), np.empty((len(keys), *sy), np.float32)
        self.read_batch(keys, x, y)
        return x, y

    def __getitem__(self, key):
        """One sample: ``(x, y)`` of shapes ``sample_shapes``."""
        x, y = self.read([key])
        return torch.from_numpy(x[0]), torch.from_numpy(y[0])


def finite_sums(*arrays) -> bool:
    """Whether the sum of each array is finite (false for any NaN or infinity in it): one
    reduction, torch's (several times faster than numpy's on large float32 arrays)."""
    return all(bool(torch.from_numpy(a).sum().isfinite()) for a in arrays)


def check_stored_dtype(path: str, name: str, dataset) -> None:
    """Refuse an HDF5 dataset whose values would not read as the same numbers in float32:
    integers wider than 16 bits, packed values (``scale_factor``/``add_offset`` attributes), and
    anything that is not a real number."""
    dt = np.dtype(dataset.dtype)
    packed = [a for a in ("scale_factor", "add_offset") if a in dataset.attrs]
    if packed:
        raise DataError(f"{path}: dataset '{name}' holds packed {dt} values ({', '.join(packed)} "
                        f"attributes): unpack them into a float32 dataset (value x scale_factor "
                        f"+ add_offset) and train on that file")
    if dt.kind not in "fiu" or f"{dt.kind}{dt.itemsize}" not in EXACT_IN_FLOAT32:
        raise DataError(f"{path}: dataset '{name}' is stored as {dt}, which does not convert "
                        f"exactly to float32: store it as float32 (or float64, float16, or "
                        f"integers of up to 16 bits)")


def read_float32(dataset, selection) -> np.ndarray:
    """``dataset[selection]`` (a slice or a tuple of slices) as float32, converted by HDF5 while
    reading: no copy of the selection in its stored type is made beside it."""
    selection = selection if isinstance(selection, tuple) else (selection,)
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(selection, dataset.shape))
    out = np.empty(shape + tuple(dataset.shape[len(selection):]), np.float32)
    dataset.read_direct(out, selection)
    return out
