"""The cosmology problem: the 3D U-Net maps N-body fields to hydrodynamic fields."""
from __future__ import annotations

import os

import h5py
import numpy as np
import torch

from datapipe import generated_data
from datapipe.formats import HYDRO_CHANNELS
from networks.unet import UNet
from observe.logging_utils import channel_lines
from observe.tensorboard import comparison_image
from settings.config import UNetConfig
from settings.errors import ConfigError
from tasks import volume_stats
from tasks.base import Task
from tasks.losses import PartialSumLoss, per_sample_sum, sum_dtype
from tasks.registry import register
from tasks.reference_weights import unet_from_reference


# The torch.compile options ({}: none) under which the channels-last U-Net compiles on a GPU and
# trains the eager numbers; None while it fails there (docs/performance.md, "With torch.compile").
CHANNELS_LAST_COMPILE_OPTIONS: dict | None = None


def rho_transform(x: torch.Tensor) -> torch.Tensor:
    """Hydro channel 0 is stored as log(density) / 14; this undoes it."""
    return torch.exp(14.0 * x)


class L1Rho(PartialSumLoss):
    """Mean absolute error per sample, plus ``lambda_rho`` times that of the density
    exp(14 x[0]) of channel 0: sums of absolute errors and counts of values."""

    def __init__(self, lambda_rho: float = 0.0):
        self.lambda_rho = lambda_rho

    def partial_sums(self, pred, target, rows=None):
        dtype = sum_dtype(pred)
        err = (pred.to(dtype) - target.to(dtype)).abs()
        sums = [per_sample_sum(err), err.new_full((err.shape[0],), err[0].numel())]
        if self.lambda_rho:
            d = (rho_transform(pred[:, 0].to(dtype)) - rho_transform(target[:, 0].to(dtype))).abs()
            sums += [per_sample_sum(d), d.new_full((d.shape[0],), d[0].numel())]
        return torch.stack(sums, dim=1)

    def finish(self, sums):
        loss = sums[:, 0] / sums[:, 1]
        if self.lambda_rho:
            loss = loss + self.lambda_rho * sums[:, 2] / sums[:, 3]
        return loss


class CosmoTask(Task):
    """N-body to hydro: L1 loss (plus the density term), predict-the-mean baseline."""

    baseline_name = "predict-the-mean"

    def __init__(self, cfg: UNetConfig):
        self.cfg = cfg
        self._mean = None
        self.channels = HYDRO_CHANNELS[: cfg.n_out_channels]
        self.loss = L1Rho(cfg.lambda_rho)  # per-sample; loss(pred, y) or partial sums of sub-volumes
        self.loss_name = "L1" + (f" + {cfg.lambda_rho} x L1 of the density" if cfg.lambda_rho else "")

    def device_batch(self, x, y):
        """Crops are used as stored: nothing to do on the device."""
        return x, y

    def memory_format(self, device: torch.device) -> tuple[torch.memory_format, str]:
        """The layout of the model's weights, its batches and the loss (``memory_format``), and
        why, for the log (docs/performance.md, "Memory format")."""
        choice = self.cfg.memory_format
        if choice == "contiguous":
            return torch.contiguous_format, ""
        compile_fails = (self.cfg.enable_jit and device.type == "cuda"
                         and CHANNELS_LAST_COMPILE_OPTIONS is None)
        if choice == "channels_last":
            if compile_fails:
                raise ConfigError(
                    "memory_format=channels_last with enable_jit: torch.compile fails on the "
                    "channels-last U-Net's backward; channels-last eager is the faster of the "
                    "two on an H200 (32.5 ms per compute-only step, the default layout compiled "
                    "36.3 ms: benchmarks/GPU.md): drop --enable_jit, or use "
                    "--memory_format auto")
            return torch.channels_last_3d, "memory_format channels_last"
        if device.type != "cuda" or self.cfg.amp_mode == "none":
            return torch.contiguous_format, ""
        if compile_fails:
            return torch.contiguous_format, (
                "memory_format auto with enable_jit: torch.compile fails on the channels-last "
                "U-Net's backward, so the default layout; channels-last without enable_jit is "
                "faster on an H200: docs/performance.md")
        return torch.channels_last_3d, f"memory_format auto: {self.cfg.amp_mode} on a GPU"

    def compile_options(self, memory_format: torch.memory_format) -> dict:
        return (CHANNELS_LAST_COMPILE_OPTIONS or {}) if memory_format == torch.channels_last_3d else {}

    def fp32_in_tf32(self) -> bool:
        """Whether fp32 FLOPs run in TF32: the U-Net's are convolutions (docs/performance.md)."""
        return torch.backends.cudnn.allow_tf32

    def build_model(self):
        c = self.cfg
        return UNet(in_chans=c.n_in_channels, out_chans=c.n_out_channels, base_width=c.base_width,
                    max_width=c.max_width, full_scale=c.full_scale, conv_init_std=c.conv_init_std,
                    leaky_relu_slope=c.leaky_relu_slope)

    def blocks(self, model) -> list:
        """The model's blocks (``Task.blocks``): the encoder's and the decoder's stages (the
        last transposed convolution stays with the whole model)."""
        return [*model.down, *model.up]

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
        return channel_lines("  Val L1 per channel", self.channels, metrics, base,
                             "predict-the-mean", ".4e")

    def metric_scalars(self, metrics: np.ndarray) -> dict:
        return {f"L1({n})/valid": float(v) for n, v in zip(self.channels, metrics)}

    def picture(self, x, y, pred) -> np.ndarray:
        """Middle slice of the gas density of the first validation crop."""
        k = y.shape[-1] // 2
        return comparison_image(y[0, 0, :, :, k].float().cpu().numpy(),
                                pred[0, 0, :, :, k].float().cpu().numpy(),
                                scale=max(1, 192 // y.shape[-2]),
                                title=f"{self.channels[0]} (log gas density), z slice {k}")

    def score(self, model, device: torch.device, autocast, opts):
        """Statistics of the whole volume predicted tile by tile (``tasks.volume_stats``)."""
        return volume_stats.score(self, model, device, autocast, opts)

    # -- what else the engine asks

    shards_model = False

    def sample_shape(self) -> tuple:
        return (self.cfg.n_in_channels, *[self.cfg.data_size] * 3)

    def forward_flops(self) -> tuple[int, int]:
        """(forward FLOPs of one sample, of which the first convolution's) for networks/unet.py:
        every layer is a 4^3 kernel of stride 2, a Conv3d costing 2 x C_in x C_out x 64 per output
        voxel (half the input's side), a ConvTranspose3d as much per input voxel (half its output's)."""
        cfg = self.cfg
        levels = 6 if cfg.full_scale else 5
        widths = [min(cfg.base_width * 2**i, cfg.max_width) for i in range(levels)]
        side = [cfg.data_size // 2**(i + 1) for i in range(levels)]  # side after down block i
        k3 = 4**3
        down = [2 * cin * cout * k3 * s**3
                for cin, cout, s in zip([cfg.n_in_channels] + widths[:-1], widths, side)]
        up = 0
        for i in reversed(range(1, levels)):  # same layers as UNet.__init__; input side is side[i]
            cin = widths[i] if i == levels - 1 else 2 * widths[i]
            up += 2 * cin * widths[i - 1] * k3 * side[i]**3
        last = 2 * (2 * widths[0]) * cfg.n_out_channels * k3 * side[0]**3
        return sum(down) + up + last, down[0]

    def from_reference(self, sd: dict, model) -> dict:
        """The tutorial model's weights ``sd`` under this model's names and layouts."""
        return unet_from_reference(sd, model.levels)


def _strided_mean(hydro, n: int) -> np.ndarray:
    """Per-channel mean of the first n channels of a (C, L, L, L) volume (array or HDF5 dataset)
    over every s-th voxel along each axis, s = L // 64 (at most 64^3 voxels read)."""
    s = max(1, hydro.shape[1] // 64)
    return np.asarray(hydro[:n, ::s, ::s, ::s], dtype=np.float64).mean(axis=(1, 2, 3))


register(UNetConfig, CosmoTask)
