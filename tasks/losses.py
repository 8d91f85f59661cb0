"""Losses and metrics. Each returns one value per sample, so that sums over samples give exact
means across batches and ranks however the samples were split. A training loss is declared as
per-sample partial sums and a finish (``PartialSumLoss``), so that the same loss serves a whole
image and a model that holds each image in bands on several ranks
(``distributed.parallelize.sharded_loss``; docs/parallelism.md).
"""
from __future__ import annotations

import numpy as np
import torch

from datapipe.formats import latitudes


def _sum_dtype(x: torch.Tensor) -> torch.dtype:
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


def _per_sample_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of each sample's values, (B, ...) -> (B,), in whatever layout ``x`` has (a
    flatten of a channels-last tensor would copy it first)."""
    return x.sum(dim=tuple(range(1, x.dim())))


class RelativeL2(PartialSumLoss):
    """||pred - target||_2 / ||target||_2 over all of a sample's values.

    Sums: [sum (pred - target)^2, sum target^2]; finish: sqrt(a) / sqrt(b)."""

    def partial_sums(self, pred, target, rows=None):
        dtype = _sum_dtype(pred)
        diff = (pred.to(dtype) - target.to(dtype)).flatten(1)
        ref = target.to(dtype).flatten(1)
        return torch.stack([diff.pow(2).sum(1), ref.pow(2).sum(1)], dim=1)

    def finish(self, sums):
        return sums[:, 0].sqrt() / sums[:, 1].sqrt()


class WeightedRelativeL2(RelativeL2):
    """RelativeL2 with each value weighted by its channel and image row: ``weights`` (C, H, 1),
    the product of the variable, pressure-level and latitude (area) weights (``loss_weights``).

    Sums: [sum w (pred - target)^2, sum w target^2]; finish: sqrt(a) / sqrt(b)."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def partial_sums(self, pred, target, rows=None):
        dtype = _sum_dtype(pred)
        w = self.weights if rows is None else self.weights[:, rows[0]:rows[1]]
        w = w.to(pred.device, dtype)
        diff = (pred.to(dtype) - target.to(dtype)).pow(2) * w
        ref = target.to(dtype).pow(2) * w
        return torch.stack([_per_sample_sum(diff), _per_sample_sum(ref)], dim=1)


def loss_weights(channels, h: int, latitude: bool, level: bool, variable: dict) -> torch.Tensor:
    """(C, H, 1) weights of ``WeightedRelativeL2``: per channel, ``variable``'s weight (1 where
    it names none) times, with ``level``, the pressure level in hPa over the mean level of the
    channels that have one (surface variables: 1), as GraphCast weights its loss; per row, with
    ``latitude``, ``latitude_weights`` (the area of its cells, mean 1)."""
    levels = {c: int(c[1:]) for c in channels if c[0] in "uvtzrq" and c[1:].isdigit()}
    mean_level = np.mean(list(levels.values())) if levels else 1.0
    per_channel = [variable.get(c, 1.0) * (levels[c] / mean_level if level and c in levels else 1.0)
                   for c in channels]
    rows = latitude_weights(h) if latitude else torch.ones(h)
    return torch.tensor(per_channel, dtype=torch.float32).view(-1, 1, 1) * rows.view(1, -1, 1)


def rho_transform(x: torch.Tensor) -> torch.Tensor:
    """Hydro channel 0 is stored as log(density) / 14; this undoes it."""
    return torch.exp(14.0 * x)


class L1Rho(PartialSumLoss):
    """Mean absolute error per sample, plus ``lambda_rho`` times that of the density
    exp(14 x[0]) of channel 0.

    Sums: [sum |pred - target|, number of values] and, with ``lambda_rho``, [sum |rho(pred_0) -
    rho(target_0)|, number of channel-0 values]; finish: the ratios, weighted."""

    def __init__(self, lambda_rho: float = 0.0):
        self.lambda_rho = lambda_rho

    def partial_sums(self, pred, target, rows=None):
        dtype = _sum_dtype(pred)
        err = (pred.to(dtype) - target.to(dtype)).abs()
        sums = [_per_sample_sum(err), err.new_full((err.shape[0],), err[0].numel())]
        if self.lambda_rho:
            d = (rho_transform(pred[:, 0].to(dtype)) - rho_transform(target[:, 0].to(dtype))).abs()
            sums += [_per_sample_sum(d), d.new_full((d.shape[0],), d[0].numel())]
        return torch.stack(sums, dim=1)

    def finish(self, sums):
        loss = sums[:, 0] / sums[:, 1]
        if self.lambda_rho:
            loss = loss + self.lambda_rho * sums[:, 2] / sums[:, 3]
        return loss


def latitude_weights(h: int) -> torch.Tensor:
    """w(j) = h cos(lat_j) / sum_k cos(lat_k): mean 1 over the rows, small near the poles."""
    c = np.cos(np.deg2rad(latitudes(h)))
    return torch.tensor(h * c / c.sum(), dtype=torch.float32)


def weighted_rmse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel: (B, C, H, W) -> (B, C)."""
    w = weights.to(pred.device).view(1, 1, -1, 1)
    return ((pred.float() - target.float()) ** 2 * w).mean(dim=(2, 3)).sqrt()
