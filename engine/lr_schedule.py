"""Learning rate: batch-size scaling of the peak, linear warm-up, cosine decay."""
from __future__ import annotations

import math

import torch

from settings.errors import ConfigError


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
    """Learning rate of the update with 0-based index ``step`` out of ``total`` updates.

    Warm-up: peak * (step + 1) / warmup for the first ``warmup`` updates (the first update already
    moves the weights). Then a cosine from peak at update ``warmup`` to ``end`` at update ``total``.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    frac = min((step - warmup) / span, 1.0)
    return end + 0.5 * (peak - end) * (1.0 + math.cos(math.pi * frac))


def build_scheduler(optimizer, peak: float, end: float, warmup: int, total: int):
    """A LambdaLR whose factor times the optimizer's initial lr (= peak) gives ``lr_at``.

    An optimizer whose lr is a device tensor (``train_graph.py``) keeps that tensor: the schedule
    fills it in place, and computes with a float peak (not a tensor on the device)."""
    set_lr(optimizer, peak)
    factor = (lambda step: 1.0) if peak == 0 else \
        (lambda step: lr_at(step, peak, end, warmup, total) / peak)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scheduler.base_lrs = [float(b) for b in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["initial_lr"] = float(group["initial_lr"])
    return scheduler


def set_lr(optimizer, value: float):
    """The learning rate of every group; one held as a device tensor (``train_graph.py``) is
    filled in place, as a captured step reads that tensor."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def resumed_schedule(optimizer, saved_cfg: dict, steps_per_epoch: int, iteration: int,
                     peak: float, end: float, warmup: int, total: int) -> str:
    """Put the learning rate of step ``iteration`` of a run of ``total`` steps in place after a
    resume. When the checkpoint's run was to end elsewhere (``--num_epochs``/``--num_iters``
    changed), the schedule now spans the new total: returns the log line that says so (else
    "")."""
    set_lr(optimizer, lr_at(iteration, peak, end, warmup, total))
    old_total = saved_cfg.get("num_iters") or (saved_cfg.get("num_epochs") or 0) * steps_per_epoch
    if not old_total or old_total == total:
        return ""
    return (f"resume: the run now ends at step {total} instead of {old_total}; the learning-rate "
            f"schedule spans the new total: lr {lr_at(iteration, peak, end, warmup, total):.3g} "
            f"at step {iteration + 1} (the old end gave "
            f"{lr_at(iteration, peak, end, warmup, old_total):.3g})")
