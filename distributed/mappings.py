"""Differentiable collectives ("mappings") for tensor and context parallelism.

Each mapping is a ``torch.autograd.Function`` whose backward is the adjoint of its forward, so
that the gradient a rank receives for its local tensor is exactly the gradient of the global
loss with respect to that tensor:

=================  ==================================  ==================================
mapping            forward                             backward
=================  ==================================  ==================================
``copy_to``        identity                            all-reduce (sum)
``reduce_from``    all-reduce (sum)                    identity
``scatter_to``     split along ``dim``, keep own chunk all-gather along ``dim``
``gather_from``    all-gather along ``dim``            split along ``dim``, keep own chunk
``all_gather``     all-gather along ``dim``            reduce-scatter (sum) along ``dim``
``reduce_scatter`` reduce-scatter (sum) along ``dim``  all-gather along ``dim``
=================  ==================================  ==================================

``gather_from`` assumes that what follows is computed identically on every rank of the group
(its output gradient is the same everywhere), ``all_gather`` that every rank uses the gathered
tensor differently (e.g. K/V of all tokens against local queries), hence the different backward.

Chunks are in group-rank order: rank r of a group of size n holds ``[r*c, (r+1)*c)`` of a
dimension of length ``n*c``. Sizes must divide evenly (a ``ValueError`` says which dimension).

``group`` is a ``torch.distributed.ProcessGroup``; ``None`` means "no group" (a single process)
and, like any group of size 1, makes every mapping the identity without communication. (This
differs from the torch.distributed convention where ``None`` means WORLD.)

The plain (non-differentiable) helpers ``all_gather_along``, ``reduce_scatter_along``,
``split_along`` and ``all_reduce`` are used by layers with hand-written backward passes.
"""
import torch
import torch.distributed as dist

__all__ = ["copy_to", "reduce_from", "scatter_to", "gather_from", "all_gather", "reduce_scatter",
           "group_size", "group_rank", "all_reduce", "all_gather_along", "reduce_scatter_along",
           "split_along"]


def group_size(group) -> int:
    """Number of ranks in ``group`` (1 for ``None`` or without torch.distributed)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank within ``group`` (0 for ``None``)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _chunk_len(x: torch.Tensor, dim: int, n: int) -> int:
    length = x.shape[dim]
    if length % n:
        raise ValueError(f"dimension {dim} of a tensor of shape {tuple(x.shape)} has length {length}, "
                         f"which is not divisible by the group size {n}")
    return length // n


# ---- plain collectives ------------------------------------------------------------------------

# Single-tensor collectives: torch 2.13 names them all_gather_single / reduce_scatter_single and
# deprecates all_gather_into_tensor / reduce_scatter_tensor; older versions have only the latter.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Older gloo builds implement neither single-tensor reduce-scatter nor all-gather on CPU (they
# raise "not supported"); torch 2.13 has both. The first such failure on a backend switches it to
# the fallbacks below (all-reduce + split, list all-gather) for the rest of the process.
_UNSUPPORTED = set()


def _is_unsupported_error(err: Exception) -> bool:
    msg = str(err).lower()
    return any(s in msg for s in ("not supported", "not implemented", "does not support", "unsupported"))


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


def all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x`` (same shape on all ranks), in rank order."""
    n = group_size(group)
    if n == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()
    backend = dist.get_backend(group)
    if backend not in _UNSUPPORTED:
        out = xt.new_empty((n * xt.shape[0],) + tuple(xt.shape[1:]))
        try:
            _all_gather_single(out, xt, group=group)
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError) as err:
            if backend != "gloo" or not _is_unsupported_error(err):
                raise
            _UNSUPPORTED.add(backend)
    parts = [torch.empty_like(xt) for _ in range(n)]
    dist.all_gather(parts, xt, group=group)
    return torch.cat(parts, dim=0).movedim(0, dim).contiguous()


def _reduce_scatter_via_all_reduce(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Reduce-scatter as all-reduce + keep own chunk (twice the traffic, but works everywhere)."""
    return split_along(all_reduce(x, group), group, dim)


def reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum of ``x`` over the group, of which this rank keeps its chunk along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    c = _chunk_len(x, dim, n)
    backend = dist.get_backend(group)
    if backend in _UNSUPPORTED:
        return _reduce_scatter_via_all_reduce(x, group, dim)
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((c,) + tuple(xt.shape[1:]))
    try:
        _reduce_scatter_single(out, xt, op=dist.ReduceOp.SUM, group=group)
    except (RuntimeError, NotImplementedError) as err:
        # gloo on CPU lacks reduce-scatter in some torch versions: fall back to all-reduce + split.
        if backend != "gloo" or not _is_unsupported_error(err):
            raise
        _UNSUPPORTED.add(backend)
        return _reduce_scatter_via_all_reduce(x, group, dim)
    return out.movedim(0, dim).contiguous()


# ---- autograd functions -----------------------------------------------------------------------

class _CopyTo(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterTo(torch.autograd.Function):
    """Forward: split along ``dim`` and keep this rank's chunk. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherFrom(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: split along ``dim``, keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.group, ctx.dim), None, None


class _AllGather(torch.autograd.Function):
    """Forward: all-gather along ``dim``. Backward: reduce-scatter (sum) along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter (sum) along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim() if x.dim() else 0


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a region computed in parallel over ``group``: forward identity, backward all-reduce."""
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group``: forward all-reduce, backward identity."""
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


def scatter_to(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along ``dim``: forward split, backward all-gather."""
    return x if group_size(group) == 1 else _ScatterTo.apply(x, group, _norm_dim(x, dim))


def gather_from(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate the chunks along ``dim``: forward all-gather, backward split (keep own chunk)."""
    return x if group_size(group) == 1 else _GatherFrom.apply(x, group, _norm_dim(x, dim))


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate the chunks along ``dim``: forward all-gather, backward reduce-scatter (sum)."""
    return x if group_size(group) == 1 else _AllGather.apply(x, group, _norm_dim(x, dim))


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep own chunk along ``dim``: forward reduce-scatter, backward all-gather."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, group, _norm_dim(x, dim))
