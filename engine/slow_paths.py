"""Known slow paths of the torch/cuDNN stack, named in one warning line at start-up
(docs/performance.md, "Known slow paths of torch and cuDNN", has the table)."""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

log = logging.getLogger(__name__)

HALF_AMP = ("bf16", "fp16")  # amp_mode values whose autocast runs convolutions in half precision
CUDNN_9_8 = 90800  # cuDNN versions as torch reports them: major * 10000 + minor * 100 + patch
CUDNN_9_15 = 91500


def cudnn_int(version) -> int:
    """cuDNN's (major, minor, patch) as the integer ``torch.backends.cudnn.version()`` gives."""
    major, minor, patch = (int(v) for v in version)
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def _dotted(version: int) -> str:
    """A cuDNN 9 version as torch reports it (``cudnn_int``), dotted."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def conv3d_slow_path(torch_version: str, cudnn_version: int | None, amp_mode: str,
                     device_type: str, *, cudnn_built: int | None = None,
                     memory_format: torch.memory_format = torch.contiguous_format) -> str | None:
    """The warning line when this torch, with cuDNN ``cudnn_version`` (``cudnn_built`` at build),
    runs ``amp_mode`` 3-D convolutions in ``memory_format`` past cuDNN; else None."""
    if device_type != "cuda" or amp_mode not in HALF_AMP \
            or memory_format == torch.channels_last_3d:
        return None
    # a released torch ("2.9.1", "2.9.1+cu128"); not a pre-release or source build ("2.9.1rc1")
    m = re.fullmatch(r"(\d+\.\d+\.\d+)(\+[\w.]+)?", torch_version.strip())
    release = m.group(1) if m else None
    wheel = "nvidia-cudnn-cu13" if "+cu13" in torch_version else "nvidia-cudnn-cu12"
    if release == "2.9.0":
        if cudnn_built is None or cudnn_built < CUDNN_9_8:
            return None
        seen = f"torch {torch_version} (built with cuDNN {_dotted(cudnn_built)})"
        fix = (f"install torch 2.9.1 with cuDNN >= 9.15 (pip install torch==2.9.1 "
               f"'{wheel}>=9.15') or torch >= 2.10")
    elif release == "2.9.1":
        if cudnn_version is None or not CUDNN_9_8 <= cudnn_version < CUDNN_9_15:
            return None
        seen = f"torch {torch_version} with cuDNN {_dotted(cudnn_version)}"
        fix = f"install cuDNN >= 9.15 (pip install '{wheel}>=9.15') or torch >= 2.10"
    else:
        return None
    return (f"Slow path: {seen} runs {amp_mode} 3-D convolutions in the default memory layout "
            f"without cuDNN (torch's fallback, reported 4x slower and using about 17x the "
            f"memory): {fix}, or train channels-last (--memory_format channels_last, without "
            f"--enable_jit)")


def convolves_in_3d(model: nn.Module) -> bool:
    """Whether ``model`` has a 3-D convolution (or transposed) with a kernel extent other than 1."""
    return any(isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)) and any(k != 1 for k in m.kernel_size)
               for m in model.modules())


def stack_versions() -> tuple[str, int | None, int | None]:
    """torch's version, the cuDNN it loaded and the cuDNN it was built with (None without)."""
    try:
        loaded = torch.backends.cudnn.version()
    except RuntimeError:  # a cuDNN torch refuses (an incompatible library): nothing to name
        loaded = None
    binding = getattr(torch._C, "_cudnn", None)
    built = cudnn_int(binding.getCompileVersion()) if binding is not None else None
    return torch.__version__, loaded, built


def warn_slow_paths(model: nn.Module, device: torch.device, amp_mode: str,
                    memory_format: torch.memory_format, is_main: bool = True) -> str | None:
    """Log (rank 0) and return the slow-path line for ``model`` as it trains, or None."""
    if not is_main or device.type != "cuda" or not convolves_in_3d(model):
        return None
    torch_version, loaded, built = stack_versions()
    line = conv3d_slow_path(torch_version, loaded, amp_mode, device.type, cudnn_built=built,
                            memory_format=memory_format)
    if line:
        log.warning(line)
    return line
