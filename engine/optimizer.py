"""The optimizer and its schedule: Adam with the config's betas, fused into one kernel per step
when asked for and available; the learning rate: batch-size scaling of the peak, linear warm-up,
cosine decay."""
from __future__ import annotations

import logging
import math

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from settings.errors import ConfigError

log = logging.getLogger(__name__)


def build_optimizer(params, lr: float, betas, fused: bool, device: torch.device,
                    for_cuda_graph: bool = False) -> torch.optim.Adam:
    """Adam over ``params`` with ``lr`` and ``betas``, no weight decay; ``fused``: the fused kernel
    where available (else a warning); ``for_cuda_graph``: fused and ``capturable`` (on a GPU), its
    lr a device tensor the schedule fills between replays."""
    params = list(params)
    kw = dict(lr=lr, betas=tuple(betas))
    # why fused Adam cannot update params on device ("": it can), before torch finds out
    supported = set(_get_fused_kernels_supported_devices())
    odd = [p for p in params if p.device.type not in supported or not torch.is_floating_point(p)]
    why = ("not asked for" if not (fused or for_cuda_graph) else
           f"no fused kernel for {device.type} (only {', '.join(sorted(supported))})"
           if device.type not in supported else
           f"a {odd[0].dtype} parameter on {odd[0].device.type} is not supported" if odd else "")
    if for_cuda_graph:
        if why:
            raise ConfigError(f"train_graph.py needs the fused Adam kernel ({why}): use train.py")
        kw.update(lr=torch.tensor(float(lr), device=device), capturable=device.type == "cuda")
    elif fused and why:
        log.warning(f"enable_fused: fused Adam is not available ({why}); "
                    f"using the default implementation")
    # (fused=None, not False: torch then picks its foreach kernels where they apply)
    return torch.optim.Adam(params, fused=None if why else True, **kw)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict):
    """``optimizer.load_state_dict(state)`` keeping this optimizer's implementation settings and
    kinds of hyperparameters (a device-tensor lr stays one), step counts where it wants them."""
    own = [dict(g) for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, before in zip(optimizer.param_groups, own):
        # how it runs, not what it learnt (train.py's checkpoints resume in train_graph.py and
        # the other way round)
        for key in ("foreach", "fused", "capturable", "differentiable"):
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


def peak_lr(lr: float, global_batch: int, base_batch: int, scaling: str) -> float:
    """lr at base_batch scaled to global_batch: unchanged, linearly, or by the square root."""
    ratio = global_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def check_end(lr: float, end: float, global_batch: int, base_batch: int, scaling: str):
    """A ConfigError where ``end`` lies above the peak: the cosine would climb to it."""
    peak = peak_lr(lr, global_batch, base_batch, scaling)
    if end > peak:
        scaled = "" if peak == lr else f" (lr {lr:g} scaled ({scaling}) to global batch {global_batch})"
        raise ConfigError(f"end_lr={end:g} is above the peak learning rate {peak:.4g}{scaled}: the "
                          f"schedule decays from the peak to end_lr; set --end_lr below the peak "
                          f"(e.g. 0), or raise --lr")


def describe(lr: float, peak: float, global_batch: int, base_batch: int, scaling: str,
             warmup: int, end: float) -> str:
    """The run header's line: the peak the schedule reaches and how it came from ``lr``."""
    scaled = "" if peak == lr else (f" = lr {lr:g} scaled ({scaling}) from batch {base_batch} "
                                    f"to {global_batch}")
    return (f"Learning rate: peak {peak:.4g}{scaled}; {warmup} warm-up steps, then a cosine to "
            f"{end:g}")


def lr_at(step: int, peak: float, end: float, warmup: int, total: int) -> float:
    """Learning rate of update ``step`` (0-based) of ``total``: peak * (step + 1) / warmup for the
    first ``warmup``, then a cosine from peak to ``end`` at update ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    frac = min((step - warmup) / span, 1.0)
    return end + 0.5 * (peak - end) * (1.0 + math.cos(math.pi * frac))


def build_scheduler(optimizer, peak: float, end: float, warmup: int, total: int):
    """A LambdaLR giving ``lr_at`` (a device-tensor lr, ``train_graph.py``'s, filled in place)."""
    set_lr(optimizer, peak)
    factor = (lambda step: 1.0) if peak == 0 else \
        (lambda step: lr_at(step, peak, end, warmup, total) / peak)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scheduler.base_lrs = [float(b) for b in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["initial_lr"] = float(group["initial_lr"])
    return scheduler


def set_lr(optimizer, value: float):
    """The learning rate of every group (a device tensor, which a captured step reads, in place)."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def resumed_schedule(optimizer, saved_cfg: dict, steps_per_epoch: int, iteration: int,
                     peak: float, end: float, warmup: int, total: int) -> str:
    """Step ``iteration``'s learning rate put in place after a resume; the line saying the schedule
    spans a new ``total`` when the run length changed, else ""."""
    set_lr(optimizer, lr_at(iteration, peak, end, warmup, total))
    old_total = saved_cfg.get("num_iters") or (saved_cfg.get("num_epochs") or 0) * steps_per_epoch
    if not old_total or old_total == total:
        return ""
    return (f"resume: the run now ends at step {total} instead of {old_total}; the learning-rate "
            f"schedule spans the new total: lr {lr_at(iteration, peak, end, warmup, total):.3g} "
            f"at step {iteration + 1} (the old end gave "
            f"{lr_at(iteration, peak, end, warmup, old_total):.3g})")
