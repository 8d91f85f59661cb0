"""Differentiable collectives ("mappings") for tensor and context parallelism.

Each mapping is a ``torch.autograd.Function`` whose backward is the adjoint of its forward, so
that the gradient a rank receives for its local tensor is exactly the gradient of the global
loss with respect to that tensor. The name says both passes:

=======================================  ==================================  ==================================
mapping                                  forward                             backward
=======================================  ==================================  ==================================
``identity_fwd_all_reduce_bwd``          identity                            all-reduce (sum)
``all_reduce_fwd_identity_bwd``          all-reduce (sum)                    identity
``all_gather_fwd_split_bwd``             all-gather along ``dim``            split along ``dim``, keep own chunk
``all_gather_fwd_reduce_scatter_bwd``    all-gather along ``dim``            reduce-scatter (sum) along ``dim``
``reduce_scatter_fwd_all_gather_bwd``    reduce-scatter (sum) along ``dim``  all-gather along ``dim``
=======================================  ==================================  ==================================

Which to use: ``identity_fwd_all_reduce_bwd`` enters a region that every rank of the group
computes on the same input (each rank's gradient is partial); ``all_reduce_fwd_identity_bwd``
sums partial results (e.g. per-band loss sums). ``all_gather_fwd_split_bwd`` assumes that what
follows is computed identically on every rank of the group (its output gradient is the same
everywhere), ``all_gather_fwd_reduce_scatter_bwd`` that every rank uses the gathered tensor
differently (e.g. K/V of all tokens against local queries), hence the different backward.

Chunks are equal and in group-rank order, but for the all-gathers' ``sizes`` (every rank's
chunk length): padded to the longest, gathered, the padding dropped. ``group``: a process group,
``None`` (the default group) or ``SINGLE_PROCESS``; over a group of size 1 every mapping is the
identity. The plain collectives serve layers with hand-written backward passes.
"""
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


def group_size(group) -> int:
    """Number of ranks in ``group`` (``None``: the default group, as in torch.distributed)."""
    return dist.get_world_size() if group is None else group.size()


def group_rank(group) -> int:
    """This process's rank within ``group``."""
    return dist.get_rank() if group is None else group.rank()


def _chunk_len(x: torch.Tensor, dim: int, n: int) -> int:
    length = x.shape[dim]
    if length % n:
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(x.shape)} has length {length}, "
                         f"which is not divisible by the group size {n}")
    return length // n


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim() if x.dim() else 0


def _check_sizes(x: torch.Tensor, group, dim: int, sizes: Optional[Sequence[int]]) -> Optional[Sequence[int]]:
    """``sizes`` when the chunks differ in length (checked against ``x``), else None."""
    if sizes is None:
        return None
    n, r = group_size(group), group_rank(group)
    if len(sizes) != n or x.shape[dim] != sizes[r]:
        raise ValueError(f"sizes={list(sizes)} must give the length of every rank's chunk along dimension {dim}: "
                         f"the group has {n} ranks and rank {r} holds {x.shape[dim]}")
    return None if min(sizes) == max(sizes) else sizes


def _pad_to(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``length`` (differentiable)."""
    extra = length - x.shape[dim]
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad)


def _drop_padding(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """From chunks of length ``max(sizes)`` along ``dim``, keep the first ``sizes[r]`` of chunk r."""
    c = max(sizes)
    return torch.cat([x.narrow(dim, r * c, s) for r, s in enumerate(sizes)], dim)


# ---- plain collectives ------------------------------------------------------------------------

# Single-tensor collectives: torch 2.13 names them all_gather_single / reduce_scatter_single and
# deprecates all_gather_into_tensor / reduce_scatter_tensor; older versions have only the latter
# (gloo has both since torch 2.2).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group, as a new tensor (``x`` is left untouched)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def split_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a copy, so the full tensor can be freed)."""
    n = group_size(group)
    if n == 1:
        return x
    c = _chunk_len(x, dim, n)
    return x.narrow(dim, group_rank(group) * c, c).contiguous()


def all_gather_along(x: torch.Tensor, group, dim: int, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x``, in rank order. The other dims must
    agree; along ``dim`` the chunks are equal, or of the lengths ``sizes`` (pad, gather, drop)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = _norm_dim(x, dim)
    sizes = _check_sizes(x, group, dim, sizes)
    xt = _pad_to(x, dim, max(sizes)) if sizes else x
    xt = xt.movedim(dim, 0).contiguous()
    out = xt.new_empty((n * xt.shape[0],) + tuple(xt.shape[1:]))
    _all_gather_single(out, xt, group=group)
    out = out.movedim(0, dim).contiguous()
    return out if sizes is None else _drop_padding(out, dim, sizes)


def reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum of ``x`` over the group, of which this rank keeps its chunk along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    c = _chunk_len(x, dim, n)
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((c,) + tuple(xt.shape[1:]))
    _reduce_scatter_single(out, xt, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


# ---- autograd ---------------------------------------------------------------------------------

def _identity(x: torch.Tensor, group, dim) -> torch.Tensor:
    return x.view_as(x)  # a new tensor object, as autograd wants from a Function


def _sum(x: torch.Tensor, group, dim) -> torch.Tensor:
    return all_reduce(x, group)


class _Mapping(torch.autograd.Function):
    """Forward ``fwd(x, group, dim)``, backward ``bwd(grad, group, dim)``: one of the pairs of
    the table above, whose backward is the adjoint of its forward."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, group, dim):
        ctx.bwd, ctx.group, ctx.dim = bwd, group, dim
        return fwd(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group, ctx.dim), None, None, None, None


@torch.compiler.disable
def eager_apply(fn, *args):
    """``fn.apply(*args)`` for an autograd Function ``fn`` that calls collectives (these mappings,
    ``distributed.layers._AllGatherLinear``), always run eagerly. Traced by torch.compile, the
    collective order would become each rank's own compiled schedule, where every rank of a group
    must issue the same collectives in the same order; so a graph break, the Function and its
    backward eager, the compute between them compiled (the DL4SCI25 reference does the same)."""
    return fn.apply(*args)


def _map(x: torch.Tensor, fwd, bwd, group, dim: Optional[int] = None,
         sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    dim = None if dim is None else _norm_dim(x, dim)
    sizes = _check_sizes(x, group, dim, sizes)
    if sizes is None:
        return eager_apply(_Mapping, x, fwd, bwd, group, dim)
    # Equal chunks on the wire: the padding is differentiable (its gradient is dropped) and the
    # dropped padding gets a zero gradient, so each rank's gradient is that of its real chunk.
    padded = eager_apply(_Mapping, _pad_to(x, dim, max(sizes)), fwd, bwd, group, dim)
    return _drop_padding(padded, dim, sizes)


def identity_fwd_all_reduce_bwd(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a region computed in parallel over ``group``: forward identity, backward all-reduce."""
    return _map(x, _identity, _sum, group)


def all_reduce_fwd_identity_bwd(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group``: forward all-reduce, backward identity."""
    return _map(x, _sum, _identity, group)


def all_gather_fwd_split_bwd(x: torch.Tensor, group, dim: int = -1,
                             sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate the chunks along ``dim``: forward all-gather, backward split (keep own chunk).
    ``sizes``: every rank's chunk length along ``dim`` when they differ."""
    return _map(x, all_gather_along, split_along, group, dim, sizes)


def all_gather_fwd_reduce_scatter_bwd(x: torch.Tensor, group, dim: int = 0,
                                      sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate the chunks along ``dim``: forward all-gather, backward reduce-scatter (sum).
    ``sizes``: every rank's chunk length along ``dim`` when they differ."""
    return _map(x, all_gather_along, reduce_scatter_along, group, dim, sizes)


def reduce_scatter_fwd_all_gather_bwd(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep own chunk along ``dim``: forward reduce-scatter, backward all-gather."""
    return _map(x, reduce_scatter_along, all_gather_along, group, dim)
