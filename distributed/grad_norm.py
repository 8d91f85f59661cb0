"""The norm of the serial model's gradient, from the shards each rank holds, and clipping by it.

``copies = tp * cp / shards`` ranks of a replica hold each slice of a parameter split over
``shards`` (``param.shard_spec.axes``), with the same (summed) gradient: each rank adds
``|grad|^2 / copies`` and one all-reduce over the replica gives the serial squared norm. Under
FSDP each rank holds a dp slice of every gradient (a DTensor): summed over dp as well.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from distributed.groups import ParallelGroups


def grad_norm(model: nn.Module, groups: ParallelGroups | None = None) -> torch.Tensor:
    """2-norm of all gradients of ``model`` as a float32 device tensor (no host sync).

    ``groups``: the model-parallel groups of a sharded model (one all-reduce over the replica);
    None for a model that is whole on every rank."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if groups is None or groups.mp_size == 1:
        if not grads:
            return torch.zeros((), device=next(model.parameters()).device)
        norm = total_norm(grads).float()
        if isinstance(norm, DTensor):  # FSDP: one all-reduce of a scalar over the dp ranks
            norm = norm.full_tensor()
        return norm
    sq = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    over_dp = False
    for p in model.parameters():
        if p.grad is None:
            continue
        shards = math.prod(groups.size(a) for a in p.shard_spec.axes)
        copies = groups.mp_size // shards
        grad = p.grad
        if isinstance(grad, DTensor):  # FSDP: this rank's slice of the dp-averaged gradient
            grad, over_dp = grad.to_local(), True
        sq += grad.float().pow(2).sum() / copies
    dist.all_reduce(sq, group=groups.mp_group)  # one scalar over the tp x cp replica
    if over_dp:  # and over the dp ranks, which hold the other slices (FSDP)
        dist.all_reduce(sq, group=groups.dp_group)
    return sq.sqrt()


def clip_grad_norm(model: nn.Module, max_norm: float, groups: ParallelGroups | None = None) -> torch.Tensor:
    """Scale the gradients so that their serial 2-norm is at most ``max_norm`` (0: measure only);
    returns the norm before clipping. With fp16 an overflowed (non-finite) gradient was already
    noted by the gradient scaler when it unscaled them, and the scaler skips that step."""
    norm = grad_norm(model, groups)
    if max_norm > 0:
        params = [p for p in model.parameters() if p.grad is not None]
        clip_grads_with_norm_(params, max_norm, norm)
    return norm


# torch 2.6 added get_total_norm and clip_grads_with_norm_; torch 2.5 (the floor, see
# engine/runtime.TORCH_FLOOR) lacks them. The fallbacks compute the same thing the same way:
# one fused norm kernel per gradient, no host sync.

def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """2-norm of the concatenation of ``grads`` (one device), as a device tensor."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def clip_grads_with_norm_(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor):
    """Scale the gradients of ``params`` in place by min(1, max_norm / (norm + 1e-6)), without
    reading ``norm`` on the host."""
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return
    grads = [p.grad for p in params]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
