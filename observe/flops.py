"""Model FLOPs of a training step, and the GPU peaks that turn achieved TFLOP/s into MFU.

FLOPs are counted analytically from the config, a multiply-add being 2 FLOPs, for the matrix
products and convolutions only (biases, norms, activations, softmax and the position-embedding
add are a fraction of a percent and left out, as ``torch.utils.flop_counter`` leaves them out).
A training step is forward + backward, and the backward of a layer costs twice its forward (the
gradient of its input and of its weight): 3 x forward, the usual convention, less the input
gradient of the first layer, which autograd never computes because the batch needs no gradient.

These are *model* FLOPs: recomputation under activation checkpointing is not counted, so MFU
says how much of the peak went into the model's own arithmetic.
"""
from __future__ import annotations

import torch

from settings.config import Config, UNetConfig, ViTConfig

# Dense (no sparsity) peak TFLOP/s of the SXM boards, from NVIDIA's datasheets; the PCIe/NVL
# boards run at lower clocks, so on them MFU reads high. The H200 has the H100 SXM's compute.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def vit_forward_flops(cfg: ViTConfig) -> tuple[int, int]:
    """(forward FLOPs of one sample, of which the patch embedding's) for networks/vit.py."""
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


def unet_forward_flops(cfg: UNetConfig) -> tuple[int, int]:
    """(forward FLOPs of one sample, of which the first convolution's) for networks/unet.py.

    Every layer is a 4^3 kernel of stride 2: a Conv3d costs 2 x C_in x C_out x 64 per output
    voxel (the output is half the input's side), a ConvTranspose3d the same per input voxel (the
    output is twice the input's side).
    """
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


def flops_per_sample(cfg: Config) -> int:
    """Training FLOPs (forward + backward) of one sample of the serial model.

    Under tensor/context parallelism the replica's ranks share each sample's FLOPs between
    them, so the total per sample is the same.
    """
    if isinstance(cfg, ViTConfig):
        forward, first = vit_forward_flops(cfg)
    elif isinstance(cfg, UNetConfig):
        forward, first = unet_forward_flops(cfg)
    else:
        raise ValueError(f"no FLOP count for model={cfg.model!r}: choose vit or unet")
    return 3 * forward - first  # the first layer computes no input gradient


def peak_tflops(device, amp_mode: str, allow_tf32: bool | None = None) -> float | None:
    """Dense peak TFLOP/s of ``device`` at the precision ``amp_mode`` computes in, or None.

    ``device``: a ``torch.device`` (a CPU gives None; a GPU is looked up by its name) or a GPU's
    name as ``torch.cuda.get_device_name`` gives it, e.g. "NVIDIA H100 80GB HBM3". A GPU not in
    ``PEAK_TFLOPS`` gives None. ``amp_mode`` none computes in fp32, at the tf32 peak when
    ``allow_tf32``: whether the switch that governs the model's FLOPs lets them run in TF32
    (the task knows which: cuBLAS's for the ViT's matmuls, cuDNN's for the U-Net's convolutions).
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = torch.cuda.get_device_name(device)
    model = next((m for m in PEAK_TFLOPS if m in device.upper()), None)
    if model is None:
        return None
    if amp_mode == "none":
        if allow_tf32 is None:
            raise ValueError("amp_mode none: say whether the model's fp32 FLOPs run in TF32")
        precision = "tf32" if allow_tf32 else "fp32"
    else:
        precision = amp_mode
    return PEAK_TFLOPS[model][precision]


def tflops_per_device(flops_per_sample: int, samples_per_s: float, world_size: int) -> float:
    """Achieved model TFLOP/s of one device, averaged over the job's devices.

    ``samples_per_s`` is the whole job's (every data-parallel replica's samples). Under
    tensor/context parallelism a replica's ranks share each sample, and the world size counts
    every rank of every replica, so dividing the job's FLOP/s by the world size still gives the
    average of one device.
    """
    return flops_per_sample * samples_per_s / world_size / 1e12
