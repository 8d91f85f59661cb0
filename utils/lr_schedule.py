"""Learning rate: batch-size scaling of the peak, linear warm-up, cosine decay."""
from __future__ import annotations

import math

import torch


def peak_lr(lr: float, global_batch: int, base_batch: int, scaling: str) -> float:
    """lr at base_batch scaled to global_batch: unchanged, linearly, or by the square root."""
    ratio = global_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


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
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(peak)
        else:
            group["lr"] = peak
    factor = (lambda step: 1.0) if peak == 0 else \
        (lambda step: lr_at(step, peak, end, warmup, total) / peak)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scheduler.base_lrs = [float(b) for b in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["initial_lr"] = float(group["initial_lr"])
    return scheduler
