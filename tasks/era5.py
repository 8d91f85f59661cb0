"""The ERA5 problem: the ViT forecasts the state of the atmosphere ``dt`` steps ahead."""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from datapipe import generated_data
from datapipe.era5_data import load_stats
from datapipe.formats import ERA5_CHANNELS
from networks.vit import ViT
from observe.logging_utils import channel_lines
from observe.tensorboard import comparison_image
from settings.config import ViTConfig
from settings.errors import ConfigError
from tasks import attention, forecast_skill
from tasks.base import Task
from tasks.losses import (PartialSumLoss, latitude_weights, per_sample_sum, sum_dtype,
                          weighted_rmse)
from tasks.registry import register
from tasks.reference_weights import vit_from_reference

log = logging.getLogger("train")


class RelativeL2(PartialSumLoss):
    """The tutorial's loss: ||pred - target||_2 / ||target||_2 over all of a sample's values,
    ``loss(pred, target)`` = ``finish(partial_sums(pred, target))``.

    Sums: [sum (pred - target)^2, sum target^2]; finish: sqrt(a) / sqrt(b)."""

    def partial_sums(self, pred, target, rows=None):
        dtype = sum_dtype(pred)
        diff = (pred.to(dtype) - target.to(dtype)).flatten(1)
        ref = target.to(dtype).flatten(1)
        return torch.stack([diff.pow(2).sum(1), ref.pow(2).sum(1)], dim=1)

    def finish(self, sums):
        return sums[:, 0].sqrt() / sums[:, 1].sqrt()

    def __call__(self, pred, target):
        if pred.dim() == 5:  # a rollout's states (B, N, C, H, W): the mean of each step's loss
            return torch.stack([self(pred[:, k], target[:, k]) for k in range(pred.shape[1])]).mean(0)
        return super().__call__(pred, target)


class WeightedRelativeL2(RelativeL2):
    """RelativeL2 with each value weighted by its channel and image row: ``weights`` (C, H, 1),
    the product of the variable, pressure-level and latitude (area) weights (``loss_weights``).

    Sums: [sum w (pred - target)^2, sum w target^2]; finish: sqrt(a) / sqrt(b)."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def partial_sums(self, pred, target, rows=None):
        dtype = sum_dtype(pred)
        w = self.weights if rows is None else self.weights[:, rows[0]:rows[1]]
        w = w.to(pred.device, dtype)
        diff = (pred.to(dtype) - target.to(dtype)).pow(2) * w
        ref = target.to(dtype).pow(2) * w
        return torch.stack([per_sample_sum(diff), per_sample_sum(ref)], dim=1)


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


class ERA5Task(Task):
    """One-step forecast: relative L2 loss, latitude-weighted RMSE per channel, persistence."""

    baseline_name = "persistence"

    def __init__(self, cfg: ViTConfig):
        self.cfg = cfg
        self.channels = ERA5_CHANNELS[: cfg.n_out_channels]
        self.weights = latitude_weights(cfg.img_size[0])
        # per-sample; loss(pred, y) or partial sums of image bands
        variable = cfg.variable_weights()
        weighted = [what for what, on in (("latitude (area)", cfg.loss_latitude_weights),
                                          ("pressure level", cfg.loss_level_weights),
                                          ("variable", variable)) if on]
        self.loss = WeightedRelativeL2(loss_weights(
            self.channels, cfg.img_size[0], cfg.loss_latitude_weights, cfg.loss_level_weights,
            variable)) if weighted else RelativeL2()
        self.loss_name = "relative L2, " + (f"weighted by {', '.join(weighted)}" if weighted
                                            else "unweighted (the tutorial's)")
        self._stats = {}  # device -> (mean_in, inv_std_in, mean_out, inv_std_out), (1, C, 1, 1)
        self.kernels = contextlib.nullcontext  # the forward's attention kernels (forward_kernels)
        self._steps_said = None  # the rollout steps the log last gave

    def device_batch(self, x, y):
        """Normalise a batch as delivered by the loader (raw values, on the device already) with
        the global means and stds: the first operation of the step, on the device."""
        if x.device not in self._stats:
            c = self.cfg
            means, stds = (generated_data.era5_stats(c) if c.data_is_generated
                           else load_stats(c.data_root, max(c.n_in_channels, c.n_out_channels)))
            mean = torch.from_numpy(means).unsqueeze(0).to(x.device)  # (1, C, 1, 1)
            inv_std = torch.from_numpy(1.0 / stds).unsqueeze(0).to(x.device)
            self._stats[x.device] = (mean[:, : c.n_in_channels], inv_std[:, : c.n_in_channels],
                                     mean[:, : c.n_out_channels], inv_std[:, : c.n_out_channels])
        mean_in, inv_std_in, mean_out, inv_std_out = self._stats[x.device]
        return (x - mean_in) * inv_std_in, (y - mean_out) * inv_std_out

    def training_loss(self, model, x, y, loss, epoch: int) -> torch.Tensor:
        """Rollout training (docs/training.md): the mean of ``loss`` over the epoch's steps, each
        fed the model's previous output (tp/cp: its band of rows). One target: the base's step."""
        if y.dim() == x.dim():
            return super().training_loss(model, x, y, loss, epoch)
        steps = self.cfg.rollout_at(epoch)
        if steps != self._steps_said:  # at the start, and where the schedule changes them
            self._steps_said = steps
            log.info(f"Rollout training: {steps} step{'s' * (steps > 1)} a sample from epoch "
                     f"{epoch + 1}")
        # (recomputed with the forward's attention kernel: another saves other tensors)
        recompute = lambda: (contextlib.nullcontext(), self.kernels())  # noqa: E731
        total = 0
        for k in range(steps):
            x = (checkpoint(model, x, use_reentrant=False, context_fn=recompute)
                 if self.cfg.rollout_checkpointing else model(x))
            total = total + loss(x, y[:, k])
        return total / steps

    def flops_per_sample(self, epoch: int = 0) -> int:
        """Each of the epoch's rollout steps is a forward and backward pass (the recomputation of
        ``rollout_checkpointing`` is not the model's work: not counted)."""
        return super().flops_per_sample() * self.cfg.rollout_at(epoch)

    def forecast(self, model, x, whole) -> torch.Tensor:
        """Validation: the whole outputs of the run's ``rollout_max`` steps from ``x``, (B, N, C,
        H, W), each step fed the previous one's output; one step's, (B, C, H, W), as the base."""
        if self.cfg.rollout_max == 1:
            return super().forecast(model, x, whole)
        leads = []
        for _ in range(self.cfg.rollout_max):
            x = model(x)
            leads.append(whole(x))
        return torch.stack(leads, dim=1)

    def forward_kernels(self, device: torch.device, dtype: torch.dtype):
        """The context the forward pass runs under: the attention's kernel (tasks.attention)."""
        c = self.cfg
        self.kernels = attention.kernels(c.attention_backend, device, dtype,
                                         c.embed_dim // c.num_heads)
        return self.kernels

    def fp32_in_tf32(self) -> bool:
        """Whether fp32 FLOPs run in TF32: the ViT's are matmuls (cuBLAS's switch)."""
        return torch.backends.cuda.matmul.allow_tf32

    def build_model(self):
        c = self.cfg
        return ViT(img_size=c.img_size, patch_size=c.patch_size, in_chans=c.n_in_channels,
                   out_chans=c.n_out_channels, embed_dim=c.embed_dim, depth=c.depth,
                   num_heads=c.num_heads, mlp_ratio=c.mlp_ratio, dropout=c.dropout,
                   layer_norm_eps=c.layer_norm_eps, head_bias=c.head_bias,
                   activation_checkpointing=c.activation_checkpointing)

    def blocks(self, model) -> list:
        """The model's blocks (``Task.blocks``): the transformer blocks."""
        return list(model.blocks)

    def metric_sums(self, pred, y) -> torch.Tensor:
        """Per-channel latitude-weighted RMSE summed over the batch, (C,); a rollout's: (C + N,)."""
        if y.dim() == 4:
            return weighted_rmse(pred, y, self.weights).sum(dim=0)
        leads = [self.loss(pred[:, k], y[:, k]).sum() for k in range(y.shape[1])]
        return torch.cat([weighted_rmse(pred[:, 0], y[:, 0], self.weights).sum(dim=0),
                          torch.stack(leads)])

    def baseline_pred(self, x, y):
        """Persistence: tomorrow's weather is today's (needs the input channels to cover the output)."""
        c = y.shape[-3]
        if x.shape[1] < c:
            return None
        return x[:, :c] if y.dim() == 4 else x[:, None, :c].expand_as(y)

    def metric_lines(self, metrics: np.ndarray, base: np.ndarray | None) -> list[str]:
        c = len(self.channels)
        lines = channel_lines("  Val lat-weighted RMSE (normalised units)", self.channels,
                              metrics[:c], None if base is None else base[:c], "persistence",
                              ".4f")
        if len(metrics) > c:  # a rollout's loss per lead step
            lines += channel_lines("  Val loss per lead step", range(1, len(metrics) - c + 1),
                                   metrics[c:], None if base is None else base[c:],
                                   "persistence", ".6f")
        return lines

    def metric_scalars(self, metrics: np.ndarray) -> dict:
        c = len(self.channels)
        return ({f"RMSE({n})/valid": float(v) for n, v in zip(self.channels, metrics)}
                | {f"Loss/valid_lead_{k}": float(v) for k, v in enumerate(metrics[c:], 1)})

    def picture(self, x, y, pred) -> np.ndarray:
        """u10 of the first validation sample (step): target | prediction | error."""
        if y.dim() == 5:
            y, pred = y[:, 0], pred[:, 0]
        return comparison_image(y[0, 0].float().cpu().numpy(), pred[0, 0].float().cpu().numpy(),
                                scale=max(1, 256 // y.shape[-1]),
                                title=f"{self.channels[0]} one step ahead",
                                units="(normalised units)")

    def skill(self, model, device: torch.device, forward, epoch: int, rank: int, world: int):
        """Every ``skill_every`` epochs: a short rollout's forecast skill (``forecast_skill``)."""
        every = self.cfg.skill_every
        if not every or (epoch + 1) % every:
            return None
        return forecast_skill.training_skill(self, model, device, forward, rank, world)

    def score(self, model, device: torch.device, autocast, opts):
        """Forecast skill over lead time (``tasks.forecast_skill``)."""
        return forecast_skill.score(self, model, device, autocast, opts)

    # -- what else the engine asks

    shards_model = True  # train_mp.py can split it over tensor/context-parallel ranks

    def sample_shape(self) -> tuple:
        return (self.cfg.n_in_channels, *self.cfg.img_size)

    def forward_flops(self) -> tuple[int, int]:
        """(forward FLOPs of one sample, of which the patch embedding's) for networks/vit.py."""
        cfg = self.cfg
        h, w = cfg.img_size
        p, e = cfg.patch_size, cfg.embed_dim
        n = (h // p) * (w // p)  # tokens
        hidden = int(e * cfg.mlp_ratio)
        embed = 2 * n * e * cfg.n_in_channels * p * p  # strided p x p conv: one (C p p -> E) per token
        block = (2 * n * e * 3 * e  # qkv
                 + 2 * n * n * e  # scores q k^T, all heads: heads x (N x hd x N)
                 + 2 * n * n * e  # attention x V
                 + 2 * n * e * e  # proj
                 + 2 * n * e * hidden * 2)  # fc1 and fc2
        head = 2 * n * e * cfg.n_out_channels * p * p
        return embed + cfg.depth * block + head, embed

    def from_reference(self, sd: dict, model) -> dict:
        """The tutorial model's weights ``sd`` under this model's names and layouts."""
        if self.cfg.head_bias and "head.bias" not in sd:
            raise ConfigError("the tutorial's ViT head has no bias: set head_bias false")
        return vit_from_reference(sd, self.cfg.patch_size, self.cfg.n_out_channels)


register(ViTConfig, ERA5Task)
