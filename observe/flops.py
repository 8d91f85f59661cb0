"""Model FLOPs of a training step, and the GPU peaks that turn achieved TFLOP/s into MFU: what
is counted, and why, is in docs/performance.md ("Model FLOPs and MFU")."""
from __future__ import annotations

import torch


# Dense (no sparsity) peak TFLOP/s of the SXM boards, from NVIDIA's datasheets; the PCIe/NVL
# boards run at lower clocks, so on them MFU reads high. The H200 has the H100 SXM's compute.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def training_flops(forward: int, first: int) -> int:
    """Training FLOPs (forward + backward) of one sample of the serial model from its forward
    FLOPs and those of its first layer (the task counts both: ``forward_flops``): 3 x forward,
    the backward of a layer costing twice its forward. Under tensor/context parallelism the
    replica's ranks share each sample's FLOPs, so the total per sample is the same."""
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

