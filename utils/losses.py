"""Losses and metrics. Each returns one value per sample, so that sums over samples give exact
means across batches and ranks however the samples were split."""
from __future__ import annotations

import numpy as np
import torch

from utils.formats import latitudes


def relative_l2(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||pred - target||_2 / ||target||_2 over all of a sample's values: (B, ...) -> (B,)."""
    b = pred.shape[0]
    diff = (pred - target).reshape(b, -1).float()
    return diff.norm(dim=1) / target.reshape(b, -1).float().norm(dim=1)


def rho_transform(x: torch.Tensor) -> torch.Tensor:
    """Hydro channel 0 is stored as log(density) / 14; this undoes it."""
    return torch.exp(14.0 * x)


def l1_rho(pred: torch.Tensor, target: torch.Tensor, lambda_rho: float = 0.0) -> torch.Tensor:
    """Mean absolute error per sample, plus lambda_rho times that of the density exp(14 x[0])."""
    b = pred.shape[0]
    loss = (pred - target).abs().reshape(b, -1).float().mean(dim=1)
    if lambda_rho:
        d = rho_transform(pred[:, 0].float()) - rho_transform(target[:, 0].float())
        loss = loss + lambda_rho * d.abs().reshape(b, -1).mean(dim=1)
    return loss


def latitude_weights(h: int) -> torch.Tensor:
    """w(j) = h cos(lat_j) / sum_k cos(lat_k): mean 1 over the rows, small near the poles."""
    c = np.cos(np.deg2rad(latitudes(h)))
    return torch.tensor(h * c / c.sum(), dtype=torch.float32)


def weighted_rmse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Latitude-weighted RMSE per sample and channel: (B, C, H, W) -> (B, C)."""
    w = weights.to(pred.device).view(1, 1, -1, 1)
    return ((pred.float() - target.float()) ** 2 * w).mean(dim=(2, 3)).sqrt()
