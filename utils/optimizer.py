"""The optimizer: Adam with the config's betas, fused into one kernel per step when asked for and
available."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def _fused_device_types() -> set:
    try:  # the device types torch has fused optimizer kernels for, on this build
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return set(_get_fused_kernels_supported_devices())
    except ImportError:
        return {"cuda"}


def fused_unavailable(params: list, device: torch.device) -> str:
    """Why the fused Adam kernel cannot update ``params`` on ``device``, or "" when it can.

    Checked before the optimizer is built: torch only checks the parameters at the first step,
    when it is too late to fall back."""
    supported = _fused_device_types()
    if device.type not in supported:
        return f"no fused kernel for {device.type} (only {', '.join(sorted(supported))})"
    for p in params:
        if p.device.type not in supported or not torch.is_floating_point(p):
            return f"a {p.dtype} parameter on {p.device.type} is not supported"
    return ""


def build_optimizer(params, cfg, lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam over ``params`` with learning rate ``lr`` and betas ``cfg.adam_betas``, no weight decay.

    ``cfg.enable_fused`` asks for the fused kernel (one launch for all parameters); where it is
    unavailable the default implementation runs instead, after a warning. Both give the same
    updates up to rounding."""
    params = list(params)
    kw = dict(lr=lr, betas=tuple(cfg.adam_betas))
    if cfg.enable_fused:
        why = fused_unavailable(params, device)
        if not why:
            return torch.optim.Adam(params, fused=True, **kw)
        log.warning(f"enable_fused: fused Adam is not available ({why}); "
                    f"using the default implementation")
    return torch.optim.Adam(params, **kw)
