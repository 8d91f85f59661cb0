"""What differs between the two problems, behind one interface the engine uses: the model, the
loss, the validation metrics, the naive baseline the log prints beside the loss, and the picture.

All per-sample quantities are summed over samples, so that sums all-reduced over ranks and
divided by the sample count are exact means however the samples were split.
"""
from __future__ import annotations

import os

import h5py
import numpy as np
import torch

from datapipe import generated_data
from datapipe.era5_data import load_stats
from datapipe.formats import ERA5_CHANNELS, HYDRO_CHANNELS
from networks.unet import UNet
from networks.vit import ViT
from observe.tensorboard import comparison_image
from settings.config import Config, UNetConfig, ViTConfig
from tasks.losses import L1Rho, RelativeL2, latitude_weights, weighted_rmse


class ERA5Task:
    """One-step forecast: relative L2 loss, latitude-weighted RMSE per channel, persistence."""

    baseline_name = "persistence"

    def __init__(self, cfg: ViTConfig):
        self.cfg = cfg
        self.channels = ERA5_CHANNELS[: cfg.n_out_channels]
        self.weights = latitude_weights(cfg.img_size[0])
        self.loss = RelativeL2()  # per-sample; loss(pred, y) or partial sums of image bands
        self._stats = {}  # device -> (mean_in, inv_std_in, mean_out, inv_std_out), (1, C, 1, 1)

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

    def metric_sums(self, pred, y) -> torch.Tensor:
        """Per-channel latitude-weighted RMSE summed over the batch: (C,)."""
        return weighted_rmse(pred, y, self.weights).sum(dim=0)

    def baseline_pred(self, x, y):
        """Persistence: tomorrow's weather is today's (needs the input channels to cover the output)."""
        return x[:, : y.shape[1]] if x.shape[1] >= y.shape[1] else None

    def metric_lines(self, metrics: np.ndarray, base: np.ndarray | None) -> list[str]:
        parts = [f"{n} {v:.4f}" for n, v in zip(self.channels, metrics)]
        lines = ["  Val lat-weighted RMSE (normalised units): " + ", ".join(parts)]
        if base is not None:
            lines.append("  Persistence RMSE: " + ", ".join(
                f"{n} {v:.4f}" for n, v in zip(self.channels, base)))
        return lines

    def metric_scalars(self, metrics: np.ndarray) -> dict:
        return {f"RMSE({n}m)/valid" if n in ("u10", "v10") else f"RMSE({n})/valid": float(v)
                for n, v in zip(self.channels, metrics)}

    def picture(self, x, y, pred) -> np.ndarray:
        """u10 of the first validation sample: target | prediction | error."""
        return comparison_image(y[0, 0].float().cpu().numpy(), pred[0, 0].float().cpu().numpy(),
                                scale=max(1, 256 // y.shape[-1]),
                                title=f"{self.channels[0]} one step ahead",
                                units="(normalised units)")


class CosmoTask:
    """N-body to hydro: L1 loss (plus the density term), predict-the-mean baseline."""

    baseline_name = "predict-the-mean"

    def __init__(self, cfg: UNetConfig):
        self.cfg = cfg
        self._mean = None
        self.channels = HYDRO_CHANNELS[: cfg.n_out_channels]
        self.loss = L1Rho(cfg.lambda_rho)  # per-sample; loss(pred, y) or partial sums of sub-volumes

    def device_batch(self, x, y):
        """Crops are used as stored: nothing to do on the device."""
        return x, y

    def fp32_in_tf32(self) -> bool:
        """Whether fp32 FLOPs run in TF32: the U-Net's are convolutions (cuDNN's switch, on by
        default in torch, unlike cuBLAS's)."""
        return torch.backends.cudnn.allow_tf32

    def build_model(self):
        c = self.cfg
        return UNet(in_chans=c.n_in_channels, out_chans=c.n_out_channels, base_width=c.base_width,
                    max_width=c.max_width, full_scale=c.full_scale, conv_init_std=c.conv_init_std,
                    leaky_relu_slope=c.leaky_relu_slope)

    def metric_sums(self, pred, y) -> torch.Tensor:
        """Mean absolute error per channel summed over the batch: (C,)."""
        return (pred.float() - y.float()).abs().mean(dim=(2, 3, 4)).sum(dim=0)

    def target_mean(self) -> np.ndarray:
        """Per-channel mean of the training targets, from an evenly strided subsample."""
        if self._mean is None:
            c = self.cfg
            if c.data_is_generated:
                self._mean = _strided_mean(generated_data.cosmo_volumes(c, "train")[1],
                                           c.n_out_channels)
            else:
                with h5py.File(os.path.join(c.data_root, c.train_file), "r") as f:
                    self._mean = _strided_mean(f["Hydro"], c.n_out_channels)
        return self._mean

    def baseline_pred(self, x, y):
        m = torch.as_tensor(self.target_mean(), dtype=y.dtype, device=y.device)
        return m.view(1, -1, 1, 1, 1).expand_as(y)

    def metric_lines(self, metrics: np.ndarray, base: np.ndarray | None) -> list[str]:
        def named(values):
            return ", ".join(f"{n} {v:.4e}" for n, v in zip(self.channels, values))
        line = "  Val L1 per channel: " + named(metrics)
        return [line] + ([f"  Predict-the-mean L1 per channel: {named(base)}"]
                         if base is not None else [])

    def metric_scalars(self, metrics: np.ndarray) -> dict:
        return {f"L1({n})/valid": float(v) for n, v in zip(self.channels, metrics)}

    def picture(self, x, y, pred) -> np.ndarray:
        """Middle slice of the gas density of the first validation crop."""
        k = y.shape[-1] // 2
        return comparison_image(y[0, 0, :, :, k].float().cpu().numpy(),
                                pred[0, 0, :, :, k].float().cpu().numpy(),
                                scale=max(1, 192 // y.shape[-2]),
                                title=f"{self.channels[0]} (log gas density), z slice {k}")


def _strided_mean(hydro, n: int) -> np.ndarray:
    """Per-channel mean of the first n channels of a (C, L, L, L) volume (array or HDF5 dataset)
    over every s-th voxel along each axis, s = L // 64 (at most 64^3 voxels read)."""
    s = max(1, hydro.shape[1] // 64)
    return np.asarray(hydro[:n, ::s, ::s, ::s], dtype=np.float64).mean(axis=(1, 2, 3))


def make_task(cfg: Config):
    return ERA5Task(cfg) if isinstance(cfg, ViTConfig) else CosmoTask(cfg)
