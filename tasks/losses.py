"""What the tasks' losses and metrics share (each task's own loss is in its module). Each
returns one value per sample, so that sums over samples give exact means across batches and
ranks however the samples were split. A training loss is declared as per-sample partial sums
and a finish (``PartialSumLoss``), so that the same loss serves a whole image and a model that
holds each image in bands on several ranks (``distributed.parallelize.sharded_loss``;
docs/parallelism.md).
"""
from __future__ import annotations

import numpy as np
import torch

from datapipe.formats import latitudes


def sum_dtype(x: torch.Tensor) -> torch.dtype:
    """Sums are taken in at least float32 (bf16/fp16 outputs under autocast)."""
    return torch.promote_types(x.dtype, torch.float32)


class PartialSumLoss:
    """A per-sample loss ``finish(partial_sums(pred, target))``: (B, ...) -> (B,).
    ``partial_sums -> (B, K)``: K sums of each sample's values (sums, counts; not means), in at
    least float32, that add up over disjoint parts of a sample; ``finish``: the loss from them."""

    def partial_sums(self, pred: torch.Tensor, target: torch.Tensor, rows=None) -> torch.Tensor:
        """``rows``: (start, stop), the image rows of a band (None: whole images)."""
        raise NotImplementedError

    def finish(self, sums: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial_sums(pred, target))


def per_sample_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of each sample's values, (B, ...) -> (B,), in whatever layout ``x`` has (a
    flatten of a channels-last tensor would copy it first)."""
    return x.sum(dim=tuple(range(1, x.dim())))


def latitude_weights(h: int) -> torch.Tensor:
    """w(j) = h cos(lat_j) / sum_k cos(lat_k): mean 1 over the rows, small near the poles."""
    c = np.cos(np.deg2rad(latitudes(h)))
    return torch.tensor(h * c / c.sum(), dtype=torch.float32)


def weighted_rmse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel: (B, C, H, W) -> (B, C)."""
    w = weights.to(pred.device).view(1, 1, -1, 1)
    return ((pred.float() - target.float()) ** 2 * w).mean(dim=(2, 3)).sqrt()
