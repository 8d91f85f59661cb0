"""The optimizer: Adam with the config's betas, fused into one kernel per step when asked for and
available."""
from __future__ import annotations

import logging

import torch

from settings.errors import ConfigError

log = logging.getLogger(__name__)


def fused_unavailable(params: list, device: torch.device) -> str:
    """Why the fused Adam kernel cannot update ``params`` on ``device``, or "" when it can
    (checked before the optimizer is built: torch checks at the first step, too late to fall
    back)."""
    try:  # the device types torch has fused optimizer kernels for, on this build
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        supported = set(_get_fused_kernels_supported_devices())
    except ImportError:
        supported = {"cuda"}
    if device.type not in supported:
        return f"no fused kernel for {device.type} (only {', '.join(sorted(supported))})"
    for p in params:
        if p.device.type not in supported or not torch.is_floating_point(p):
            return f"a {p.dtype} parameter on {p.device.type} is not supported"
    return ""


def build_optimizer(params, lr: float, betas, fused: bool, device: torch.device,
                    for_cuda_graph: bool = False) -> torch.optim.Adam:
    """Adam over ``params`` with learning rate ``lr`` and ``betas``, no weight decay; ``fused``
    (``enable_fused``): the fused kernel where available (else, after a warning, the default one).

    ``for_cuda_graph`` (``train_graph.py``): a step that can be captured in a CUDA graph. Its lr
    is a device tensor the schedule fills in place between replays (a float would be frozen into
    the graph), and it is the fused kernel, which the gradient scaler drives without a host sync.
    ``capturable`` (step counts on the device) exists on GPUs only: on a CPU it is left off."""
    params = list(params)
    kw = dict(lr=lr, betas=tuple(betas))
    if for_cuda_graph:
        why = fused_unavailable(params, device)
        if why:
            raise ConfigError(f"train_graph.py needs the fused Adam kernel ({why}): use train.py")
        kw["lr"] = torch.tensor(float(lr), device=device)
        return torch.optim.Adam(params, fused=True, capturable=device.type == "cuda", **kw)
    if fused:
        why = fused_unavailable(params, device)
        if not why:
            return torch.optim.Adam(params, fused=True, **kw)
        log.warning(f"enable_fused: fused Adam is not available ({why}); "
                    f"using the default implementation")
    return torch.optim.Adam(params, **kw)


# How an optimizer runs, not what it has learnt: kept from the running optimizer when a state is
# loaded, so that a checkpoint of train.py resumes in train_graph.py and the other way round.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict):
    """``optimizer.load_state_dict(state)`` that keeps this optimizer's implementation settings
    and the kind of its hyperparameters (a device-tensor lr, which a CUDA graph reads, stays that
    tensor, filled with the saved value; a saved tensor becomes a float where floats are held),
    and puts step counts where the implementation wants them (the parameter's device for
    capturable or fused Adam, else the CPU)."""
    own = [dict(g) for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, before in zip(optimizer.param_groups, own):
        for key in IMPLEMENTATION_KEYS:
            if key in before:
                group[key] = before[key]
        for key, value in group.items():
            mine = before.get(key)
            if torch.is_tensor(mine) and mine.dim() == 0:
                group[key] = mine.fill_(float(value))
            elif torch.is_tensor(value) and value.dim() == 0:
                group[key] = value.item()
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for key, t in st.items():  # moments in the parameter's layout (memory_format), as
                # fused and foreach kernels want them; the checkpoint's may be another
                if torch.is_tensor(t) and t.shape == p.shape and t.stride() != p.stride():
                    st[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(p.device if on_device else "cpu", torch.float32)
