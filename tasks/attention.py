"""Which kernel computes the ViT's attention (the setting ``attention_backend``, as
docs/performance.md, "The attention kernel", says): a context the forward pass runs under."""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from settings.errors import ConfigError

BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
HOPPER_ORDER = ("cudnn", "flash", "efficient", "math")  # fastest first, measured (docs/performance.md)
# Whether sdpa_kernel can set the priority of the backends it allows (torch >= 2.6).
_CAN_ORDER = "set_priority" in inspect.signature(sdpa_kernel).parameters


def auto_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...] | None:
    """The backends ``auto`` allows, first preferred, or None for torch's own choice."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not _CAN_ORDER:
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return HOPPER_ORDER if major == 9 else None


def kernels(choice: str, device: torch.device, dtype: torch.dtype,
            head_dim: int) -> Callable[[], ContextManager]:
    """A factory of the context the forward pass runs under for ``attention_backend=choice``,
    with attention computed in ``dtype`` on ``device``. A named backend is tried once here on a
    small input of the model's head size: where it has no kernel, ConfigError (one line)."""
    order = auto_order(device, dtype) if choice == "auto" else (choice,)
    if order is None:
        return contextlib.nullcontext
    backends = [getattr(SDPBackend, BACKENDS[name]) for name in order]

    def context():
        return sdpa_kernel(backends, set_priority=True) if len(backends) > 1 \
            else sdpa_kernel(backends)
    q = torch.zeros(1, 1, 8, head_dim, device=device, dtype=dtype)
    try:
        with context():
            F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"attention_backend={choice} has no kernel for {str(dtype).split('.')[-1]} attention "
            f"with heads of {head_dim} on {device.type} ({reason[:160]}): use --attention_backend "
            f"auto") from None
    return context
