"""Datasets that read whole batches straight into one buffer.

A subclass says the shapes of one sample (``sample_shapes``: input and target, without the batch
dimension) and fills preallocated float32 batch arrays in ``read_batch(keys, x, y)``; the loader
(``utils.data_loader.BatchReader``) hands it a batch's keys at once. One sample is a batch of one.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class BatchReadDataset(Dataset):
    sample_shapes: tuple  # ((C_in, ...), (C_out, ...)) of one sample

    def read_batch(self, keys, x: np.ndarray, y: np.ndarray):
        """Fill ``x[j]``, ``y[j]`` with the sample of ``keys[j]``."""
        raise NotImplementedError

    def __getitem__(self, key):
        """One sample: ``(x, y)`` of shapes ``sample_shapes``."""
        sx, sy = self.sample_shapes
        x, y = np.empty((1, *sx), np.float32), np.empty((1, *sy), np.float32)
        self.read_batch([key], x, y)
        return torch.from_numpy(x[0]), torch.from_numpy(y[0])


def finite_sums(*arrays) -> bool:
    """Whether the sum of each array is finite (false for any NaN or infinity in it): one
    reduction, torch's being several times faster than numpy's on large float32 arrays."""
    return all(bool(torch.from_numpy(a).sum().isfinite()) for a in arrays)
