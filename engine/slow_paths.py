"""Known slow paths of the torch/cuDNN stack, named in one warning line at start-up.

torch 2.9.0 and 2.9.1 send half-precision 3-D convolutions past cuDNN to torch's own kernels (a
workaround for wrong cuDNN results, torch issue 163539; the fallback was reported 4x slower and
using about 17x the memory, torch issue 166643). The conditions are torch's, in
``ConvParams::use_cudnn`` of ``aten/src/ATen/native/Convolution.cpp``, as compiled in the
released torch 2.9.0 and 2.9.1 wheels. cuDNN is skipped when all of these hold:

- the input is bfloat16 or float16 (``bf16``/``fp16`` autocast; float32 keeps cuDNN);
- the weight is 5-D (``Conv3d``, ``ConvTranspose3d``) with a kernel extent other than 1
  (1x1x1 kernels keep cuDNN);
- input and weight are in the default layout (``cudnn_conv_suggest_memory_format`` says
  ``Contiguous``): channels-last 3-D (``--memory_format channels_last``) keeps cuDNN;
- the cuDNN version is in the range below, read once per process:

  ========  ==========================================================  ===================
  torch     the cuDNN version it reads                                  off cuDNN when
  ========  ==========================================================  ===================
  2.9.0     the one torch was built with (``versionCuDNN()``; Python:   >= 9.8.0
            ``torch._C._cudnn.getCompileVersion()``; 9.8.0 in PyPI's
            cu128 wheel)
  2.9.1     the one loaded (``versionRuntimeCuDNN()``; Python:          9.8.0 to 9.14.x
            ``torch.backends.cudnn.version()``; PyPI's wheels bring
            9.10.2)
  ========  ==========================================================  ===================

torch 2.8.0, 2.10.0, 2.11.0 and 2.13.0 have no such condition (2.10 keeps cuDNN and leaves out
one of its engines for 3-D convolutions instead). Pre-releases and source builds of 2.9 are not
named: which of the two conditions they hold is not known here. A TF32 switch-off for 3-D
convolutions on cuDNN 9.10.2 to 9.15 (proposed upstream in torch pull request 167024) is not in
the compiled convolution code of torch 2.9.1 or 2.10.0 (PyPI cu128 wheels) and is not named.
"""
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
    major = version // 10000 if version >= 90000 else version // 1000
    rest = version - major * (10000 if major >= 9 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _release(torch_version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a released torch ("2.9.1", "2.9.1+cu128"); None for a
    pre-release or source build ("2.9.0a0+git...", "2.9.1rc1")."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(\+[\w.]+)?", torch_version.strip())
    return tuple(int(g) for g in m.groups()[:3]) if m else None


def _cudnn_wheel(torch_version: str) -> str:
    return "nvidia-cudnn-cu13" if "+cu13" in torch_version else "nvidia-cudnn-cu12"


def conv3d_slow_path(torch_version: str, cudnn_version: int | None, amp_mode: str,
                     device_type: str, *, cudnn_built: int | None = None,
                     memory_format: torch.memory_format = torch.contiguous_format) -> str | None:
    """The warning line when this torch, with cuDNN ``cudnn_version`` loaded (and
    ``cudnn_built``, the one it was built with), runs ``amp_mode`` 3-D convolutions on a
    ``device_type`` device in ``memory_format`` past cuDNN; else None. The conditions are
    those of the module's docstring."""
    if device_type != "cuda" or amp_mode not in HALF_AMP \
            or memory_format == torch.channels_last_3d:
        return None
    release = _release(torch_version)
    wheel = _cudnn_wheel(torch_version)
    if release == (2, 9, 0):
        if cudnn_built is None or cudnn_built < CUDNN_9_8:
            return None
        seen = f"torch {torch_version} (built with cuDNN {_dotted(cudnn_built)})"
        fix = (f"install torch 2.9.1 with cuDNN >= 9.15 (pip install torch==2.9.1 "
               f"'{wheel}>=9.15') or torch >= 2.10")
    elif release == (2, 9, 1):
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
    """Whether ``model`` has a 3-D convolution, plain or transposed, with a kernel extent other
    than 1: the ones the slow path takes."""
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
    """Log (rank 0) and return the slow-path line for ``model`` trained on ``device`` with
    ``amp_mode`` in ``memory_format``, or None: a model without 3-D convolutions, a CPU, fp32
    and the known-good versions say nothing."""
    if not is_main or device.type != "cuda" or not convolves_in_3d(model):
        return None
    torch_version, loaded, built = stack_versions()
    line = conv3d_slow_path(torch_version, loaded, amp_mode, device.type, cudnn_built=built,
                            memory_format=memory_format)
    if line:
        log.warning(line)
    return line
