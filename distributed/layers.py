"""Tensor / context / sequence parallel layers of the ViT, and gradient reduction (the layout:
docs/parallelism.md, "How model parallelism works"). Token tensors are ``(B, N, E)``.

Every parameter carries ``param.shard_spec`` (:class:`ShardSpec`: how it is cut out of the
serial parameter of the same name) and ``param.reduce_over``: the axes over which its identical
copies see *different* tokens, each holding a partial gradient, summed by
:func:`replicated_grads_comm_hook` under DDP, :func:`reduce_replicated_grad_shards` otherwise.
"""
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from distributed.groups import ParallelGroups
from distributed.mappings import (all_gather_along, all_gather_fwd_reduce_scatter_bwd,
                                  all_reduce_fwd_identity_bwd, eager_apply,
                                  identity_fwd_all_reduce_bwd, reduce_scatter_along,
                                  reduce_scatter_fwd_all_gather_bwd)
from networks.vit import PatchEmbed


# ---- helpers ----------------------------------------------------------------------------------

def divisor_choices(n: int, limit: int = 12) -> str:
    """``8 -> "1, 2, 4 or 8"`` (at most ``limit`` divisors, then "...")."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    if len(divs) > limit:
        return ", ".join(map(str, divs[:limit])) + ", ..."
    return ", ".join(map(str, divs[:-1])) + f" or {divs[-1]}" if len(divs) > 1 else str(divs[0])


def check_divisible(what: str, n: int, by_name: str, by: int):
    """``ValueError("tensor_parallel=3 does not divide num_heads=8: choose 1, 2, 4 or 8")``."""
    if n % by:
        raise ValueError(f"{by_name}={by} does not divide {what}={n}: choose {divisor_choices(n)}")


def split_bounds(length: int, parts: int, index: int) -> Tuple[int, int]:
    """``(start, stop)`` of part ``index`` when ``length`` items are cut into ``parts`` contiguous
    parts whose lengths differ by at most one, the longer ones first: 45 patch rows in 4 parts
    are 12, 11, 11 and 11 rows. Equal parts when ``parts`` divides ``length``."""
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def axes_index(groups: ParallelGroups, axes: Sequence[str]) -> Tuple[int, int]:
    """``(number of chunks, this rank's chunk)`` when something is cut over ``axes``, outer to
    inner: with ``("cp", "tp")`` the rank holds chunk ``cp_rank * tp + tp_rank`` of ``cp * tp``."""
    n, idx = 1, 0
    for a in axes:
        n, idx = n * groups.size(a), idx * groups.size(a) + groups.rank_in(a)
    return n, idx


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` (or the module itself)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def _token_axes(sequence_parallel: bool) -> Tuple[str, ...]:
    return ("cp", "tp") if sequence_parallel else ("cp",)


# ---- shard specs and replicated-parameter markers ---------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to the serial parameter of the same name.

    ``axes == ()``: replicated (the local tensor is the serial tensor). Otherwise the serial
    tensor, viewed as ``view`` (if given), is cut along ``dim`` into ``prod(size(a) for a in
    axes)`` contiguous chunks of whole units of ``unit`` elements, whose lengths differ by at
    most one unit (:func:`split_bounds`; ``unit`` = patch columns cuts tokens in whole patch
    rows), the rank's chosen by :func:`axes_index`. With a ``view`` the chunk is reshaped to
    ``(-1, *full_shape[1:])``.
    """

    full_shape: Tuple[int, ...]
    axes: Tuple[str, ...] = ()
    dim: int = 0
    view: Optional[Tuple[int, ...]] = None
    unit: int = 1

    def _bounds(self, n: int, idx: int) -> Tuple[int, int]:
        """(start, stop) along ``dim`` of chunk ``idx`` of ``n``."""
        length = (self.view or self.full_shape)[self.dim]
        if length % self.unit:
            raise ValueError(f"dimension {self.dim} of length {length} is not made of units of {self.unit}")
        start, stop = split_bounds(length // self.unit, n, idx)
        return start * self.unit, stop * self.unit

    def shard(self, full: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(f"expected a serial tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        n, idx = axes_index(groups, self.axes)
        if n == 1:
            return full
        t = full.reshape(self.view) if self.view else full
        start, stop = self._bounds(n, idx)
        chunk = t.narrow(self.dim, start, stop - start)
        return chunk if self.view is None else chunk.reshape((-1,) + tuple(self.full_shape[1:]))

    def gather(self, local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        """Collective over the spec's axes: reassemble the serial tensor on every rank."""
        n, idx = axes_index(groups, self.axes)
        if n == 1:
            return local
        sizes = [stop - start for start, stop in (self._bounds(n, i) for i in range(n))]
        view = list(self.view or self.full_shape)
        view[self.dim] = sizes[idx]
        t = local.reshape(view)
        inner = 1  # chunks already gathered into t: innermost axis first, so tp chunks form a cp chunk
        for a in reversed(self.axes):
            g = groups.size(a)
            first = idx // (inner * g) * (inner * g)  # the first chunk this gather covers
            members = [sum(sizes[first + j * inner:first + (j + 1) * inner]) for j in range(g)]
            t = all_gather_along(t, groups.group(a), self.dim, members)
            inner *= g
        return t.reshape(self.full_shape)


def sharded_parameter(shape, spec: ShardSpec, reduce_over: Sequence[str], dtype=None, device=None) -> nn.Parameter:
    """A zero parameter of the local ``shape`` with its ``shard_spec`` and ``reduce_over`` markers;
    its values come from the serial model (``load_serial_state_dict``)."""
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    p.shard_spec, p.reduce_over = spec, tuple(reduce_over)
    return p


def mark_module_replicated(module: nn.Module, reduce_over: Sequence[str]):
    """Mark every parameter of an unsharded module as replicated over ``reduce_over``."""
    for p in module.parameters():
        p.shard_spec, p.reduce_over = ShardSpec(tuple(p.shape)), tuple(reduce_over)


def _spec(p: nn.Parameter) -> ShardSpec:
    """``p.shard_spec``; a parameter without one is whole on every rank."""
    return getattr(p, "shard_spec", None) or ShardSpec(tuple(p.shape))


def load_serial_state_dict(module: nn.Module, state_dict: Dict[str, torch.Tensor], groups: ParallelGroups):
    """Copy this rank's slices of a *serial* state dict (a serial model's or checkpoint's, or
    :func:`serial_state_dict` of any tp/cp layout) into a parallel module (no communication)."""
    module = unwrap(module)
    state_dict = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    names = dict(module.named_parameters())
    missing = sorted(set(names) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(names))
    if missing or unexpected:
        raise KeyError(f"serial state dict does not match the model: missing {missing}, "
                       f"unexpected {unexpected}")
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(_spec(p).shard(state_dict[name].to(device=p.device, dtype=p.dtype), groups))


def tensors_to_serial(module: nn.Module, groups: ParallelGroups,
                      tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Per-parameter tensors shaped like the local parameters (gradients, Adam moments, ...) in
    the serial layout, on every rank. Collective over tp and cp (the same names on every rank)."""
    params = dict(unwrap(module).named_parameters())
    out = {}
    for name, t in tensors.items():
        key = name[len("module."):] if name.startswith("module.") and name not in params else name
        out[key] = _spec(params[key]).gather(t.detach(), groups).clone()
    return out


def tensors_from_serial(module: nn.Module, groups: ParallelGroups,
                        tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This rank's slices of serial-layout per-parameter tensors (inverse of ``tensors_to_serial``)."""
    params = dict(unwrap(module).named_parameters())
    return {name: _spec(params[name]).shard(t, groups).clone() for name, t in tensors.items()}


def serial_state_dict(module: nn.Module, groups: ParallelGroups, grads: bool = False) -> Dict[str, torch.Tensor]:
    """The serial-layout state dict (or gradients, after their reduction, missing ones as zeros:
    ``grads=True``) of a parallel module, on every rank. Collective over tp and cp."""
    module = unwrap(module)
    tensors = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
               for name, p in module.named_parameters()}
    return tensors_to_serial(module, groups, tensors)


# ---- gradient reduction of replicated parameters ----------------------------------------------

def _reduce_key(param: nn.Parameter, groups: ParallelGroups) -> Optional[str]:
    """The group ``param``'s gradient is summed over: "mp" for both cp and tp (one all-reduce
    instead of two), or None."""
    axes = tuple(a for a in ("cp", "tp") if a in getattr(param, "reduce_over", ()) and groups.size(a) > 1)
    return {("cp",): "cp", ("tp",): "tp", ("cp", "tp"): "mp"}.get(axes)


def _all_reduce_coalesced(tensors, group, scale: Optional[float] = None):
    """In-place sum (times ``scale``) of same-dtype ``tensors`` over ``group``, in one call per dtype."""
    by_dtype = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for dtype in sorted(by_dtype, key=str):
        ts = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in ts])
        if scale is not None:
            flat.mul_(scale)
        dist.all_reduce(flat, group=group)
        for t, part in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(part.view_as(t))


def _reduce_marked(pairs, groups: ParallelGroups):
    """Sum gradients of marked parameters over their groups; ``pairs`` = [(param, grad)]."""
    by_key = defaultdict(list)
    for p, g in pairs:
        key = _reduce_key(p, groups)
        if key is not None:
            by_key[key].append(g)
    for key in sorted(by_key):  # same order on every rank
        _all_reduce_coalesced(by_key[key], groups.group(key))


def reduce_replicated_grad_shards(model: nn.Module, groups: ParallelGroups, average_dp: bool = False):
    """After ``backward``, where no DDP hook (:func:`replicated_grads_comm_hook`) did it: sum the
    gradients of parameters with ``reduce_over`` over those axes (each rank computed them from
    its own tokens only). Under FSDP the gradients are DTensors, reduce-scattered and averaged
    over dp: every tp/cp copy of a replicated parameter holds the same dp slice of it, so the
    slices are summed as the whole gradients would be. Without FSDP or DDP, ``average_dp`` also
    averages every gradient over dp, which gives what DDP with the hook gives."""
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    _reduce_marked(list(zip(params, grads)), groups)
    if average_dp and groups.dp_size > 1:
        _all_reduce_coalesced(grads, groups.dp_group, scale=1.0 / groups.dp_size)


def replicated_grads_comm_hook(groups: ParallelGroups, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (DDP over ``groups.dp_group``): sum marked gradients over tp/cp,
    synchronously (every rank of a tp/cp group has the same buckets in the same order), then
    average the bucket over dp, asynchronously as DDP expects."""
    buf = bucket.buffer()
    # DDP's bucket buffer holds the bucket's parameters' gradients back to back, in order.
    params = bucket.parameters()
    _reduce_marked(list(zip(params, buf.split([p.numel() for p in params]))), groups)
    if groups.dp_size > 1:
        buf.div_(groups.dp_size)
        work = dist.all_reduce(buf, group=groups.dp_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# ---- linear layers ----------------------------------------------------------------------------

class _AllGatherLinear(torch.autograd.Function):
    """``F.linear(all_gather(x, dim), w, b)`` over ``group`` that keeps only the local ``x`` for
    backward: grad_x = reduce-scatter(grad @ w), and grad_w's input is all-gathered again. Under
    autocast ``x`` is cast to the autocast dtype *before* it is saved and gathered, as
    ``F.linear`` would cast the gathered tensor: the same result bit for bit, half the bytes
    saved and sent; ``grad_x`` comes back in ``x``'s own dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        ctx.x_dtype, device = x.dtype, x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        return F.linear(all_gather_along(x, group, dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        cdt = grad.dtype  # under autocast the output (and its gradient) may be lower precision
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_along(grad.matmul(weight.to(cdt)), ctx.group, ctx.dim).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x_full = all_gather_along(x, ctx.group, ctx.dim).to(cdt)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(
                x_full.reshape(-1, x_full.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


class _ParallelLinear(nn.Module):
    """What column- and row-parallel linears share: the matmul of this rank's slice,
    ``local_linear(x, weight, bias)``: ``F.linear``, or another function of the same contract put
    in its place (the fp8 matmul of ``engine.fp8_linears``); the collectives stay the layer's."""

    local_linear = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, sequence_parallel: bool):
        super().__init__()
        self.groups, self.sequence_parallel = groups, sequence_parallel
        self.in_features, self.out_features = in_features, out_features


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features split over tp.

    * ``weight`` (out/tp, in) and ``bias`` (out/tp): rows ``[r*out/tp, (r+1)*out/tp)`` of the
      serial ones on tp rank r, or with ``stacked=k`` (e.g. 3 for a fused [q | k | v] output)
      that range taken from each of the k equal blocks. Replicated over cp
      (``reduce_over=("cp",)``): cp ranks see different tokens.
    * input: ``sequence_parallel=True``: (B, N/tp, in), tokens split over tp; they are
      all-gathered (the gathered tensor is not kept for backward). ``False``: the full input,
      replicated over tp (``identity_fwd_all_reduce_bwd``).
    * output: (B, N, out/tp), all tokens of this cp rank, features split over tp.
    """

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, bias: bool = True,
                 sequence_parallel: bool = True, stacked: int = 1, dtype=None, device=None):
        super().__init__(in_features, out_features, groups, sequence_parallel)
        tp = groups.tp_size
        if out_features % stacked:
            raise ValueError(f"out_features={out_features} is not divisible by stacked={stacked}")
        check_divisible("out_features" if stacked == 1 else "out_features per stacked block",
                        out_features // stacked, "tensor_parallel", tp)
        self.stacked = stacked
        blocks = (stacked, out_features // stacked)  # each block split over tp
        self.weight = sharded_parameter((out_features // tp, in_features),
                                        ShardSpec((out_features, in_features), ("tp",), 1, blocks + (in_features,)),
                                        ("cp",), dtype, device)
        self.bias = sharded_parameter((out_features // tp,), ShardSpec((out_features,), ("tp",), 1, blocks),
                                      ("cp",), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp_group = self.groups.tp_group
        if self.sequence_parallel and self.groups.tp_size > 1:
            if self.local_linear is F.linear:
                # its forward and backward call collectives: kept out of torch.compile's graphs
                return eager_apply(_AllGatherLinear, x, self.weight, self.bias, tp_group, 1)
            # Another matmul (fp8): the tokens gathered in the autocast dtype as _AllGatherLinear
            # does, but the matmul keeps the gathered input for backward, not this rank's slice.
            if torch.is_autocast_enabled(x.device.type):
                x = x.to(torch.get_autocast_dtype(x.device.type))
            x = all_gather_fwd_reduce_scatter_bwd(x, tp_group, 1)
            return self.local_linear(x, self.weight, self.bias)
        return self.local_linear(identity_fwd_all_reduce_bwd(x, tp_group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (/{self.groups.tp_size} over tp), "
                f"stacked={self.stacked}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features split over tp.

    * ``weight`` (out, in/tp): columns ``[r*in/tp, (r+1)*in/tp)`` of the serial weight on tp
      rank r; replicated over cp (``reduce_over=("cp",)``).
    * ``bias`` (out): replicated over tp and cp; added after the reduction, to the rank's own
      tokens, so ``reduce_over=("cp", "tp")`` with sequence parallelism, ``("cp",)`` without.
    * input: (B, N, in/tp), features split over tp (output of a column-parallel layer).
    * output: partial sums over tp are reduce-scattered along the tokens (``sequence_parallel=
      True``, output tokens split over tp) or all-reduced (``False``, output replicated over tp).
    """

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, bias: bool = True,
                 sequence_parallel: bool = True, dtype=None, device=None):
        super().__init__(in_features, out_features, groups, sequence_parallel)
        tp = groups.tp_size
        check_divisible("in_features", in_features, "tensor_parallel", tp)
        self.weight = sharded_parameter((out_features, in_features // tp),
                                        ShardSpec((out_features, in_features), ("tp",), 1), ("cp",), dtype, device)
        self.bias = sharded_parameter((out_features,), ShardSpec((out_features,)), _token_axes(sequence_parallel),
                                      dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size == 1:  # nothing to reduce: the serial op, fused bias
            return self.local_linear(x, self.weight, self.bias)
        y = self.local_linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_fwd_all_gather_bwd(y, self.groups.tp_group, 1)
        else:
            y = all_reduce_fwd_identity_bwd(y, self.groups.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (/{self.groups.tp_size} over tp), out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


# ---- dropout ----------------------------------------------------------------------------------

class ReplicatedDropout(nn.Dropout):
    """Dropout on an activation that every tp rank holds whole (``sequence_parallel=False``,
    tp > 1): the ranks' random streams differ, so tp rank 0 draws the keep-mask and broadcasts it
    over tp (a recomputation draws it again from the restored RNG state). Otherwise, and in eval
    mode, ``nn.Dropout``."""

    def __init__(self, p: float, groups: ParallelGroups, sequence_parallel: bool = True):
        super().__init__(p)
        self.groups = groups
        self.synchronized = not sequence_parallel and groups.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.synchronized and self.training and self.p > 0):
            return super().forward(x)
        # the uint8 mask is what autograd keeps for backward (1 byte per element, as nn.Dropout)
        return x * self._shared_mask(x) * (0.0 if self.p >= 1 else 1.0 / (1.0 - self.p))

    @torch.compiler.disable
    def _shared_mask(self, x: torch.Tensor) -> torch.Tensor:
        """tp rank 0's keep-mask, broadcast over tp. Run eagerly under torch.compile, like the
        collectives of ``distributed.mappings`` (``eager_apply``): the broadcast is not traced, and
        the mask comes from the rank's eager random stream, as without compilation."""
        keep = torch.empty(x.shape, dtype=torch.uint8, device=x.device).bernoulli_(1.0 - self.p)
        dist.broadcast(keep, src=self.groups.tp_ranks[0], group=self.groups.tp_group)
        return keep

    def extra_repr(self) -> str:
        return super().extra_repr() + (", same mask on every tp rank" if self.synchronized else "")


# ---- transformer layers -----------------------------------------------------------------------

class TokenShardedLayerNorm(nn.LayerNorm):
    """LayerNorm of a token-sharded input, per token; ``weight`` and ``bias`` are replicated, their
    gradients summed over the ranks holding other tokens (cp, and tp with sequence parallelism)."""

    def __init__(self, dim: int, eps: float = 1e-5, sequence_parallel: bool = True, dtype=None, device=None):
        super().__init__(dim, eps=eps, dtype=dtype, device=device)
        mark_module_replicated(self, _token_axes(sequence_parallel))


class ParallelMLP(nn.Module):
    """fc1 (column-parallel) -> GELU -> fc2 (row-parallel): the hidden dim is split over tp; the
    hidden activation's dropout uses each rank's own stream, the output's is replicated."""

    def __init__(self, dim: int, hidden_dim: int, groups: ParallelGroups, drop: float = 0.0,
                 sequence_parallel: bool = True, dtype=None, device=None):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(dim, hidden_dim, groups, **kw)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(hidden_dim, dim, groups, **kw)
        self.drop = nn.Dropout(drop)
        self.out_drop = ReplicatedDropout(drop, groups, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class ParallelAttention(nn.Module):
    """Multi-head self-attention, heads split over tp (``qkv`` column-parallel, [q | k | v]
    stacked; ``proj`` row-parallel) and tokens over cp: the local heads' keys and values are
    all-gathered over cp (gradients reduce-scattered back), so every query sees all ``N`` tokens.
    Input/output: (B, n/tp, E) with sequence parallelism, else (B, n, E), ``n`` the tokens of the
    cp band (padding included). ``band_tokens``: the real tokens of every cp band, in cp-rank
    order (``None``: all real, the bands equal); the padding beyond them is never a key or value.
    """

    def __init__(self, dim: int, num_heads: int, groups: ParallelGroups, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, sequence_parallel: bool = True,
                 band_tokens: Optional[Sequence[int]] = None, dtype=None, device=None):
        super().__init__()
        if band_tokens is not None:
            band_tokens = tuple(int(n) for n in band_tokens)
            if len(band_tokens) != groups.cp_size or min(band_tokens) < 1:
                raise ValueError(f"band_tokens={list(band_tokens)} must give the (positive) number of real tokens "
                                 f"of each of the context_parallel={groups.cp_size} bands")
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        tp = groups.tp_size
        check_divisible("num_heads", num_heads, "tensor_parallel", tp)
        self.groups, self.band_tokens = groups, band_tokens
        self.num_heads, self.local_heads, self.head_dim = num_heads, num_heads // tp, dim // num_heads
        kw = dict(sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.qkv = ColumnParallelLinear(dim, 3 * dim, groups, stacked=3, **kw)
        self.proj = RowParallelLinear(dim, dim, groups, **kw)
        self.attn_drop = attn_drop
        self.proj_drop = ReplicatedDropout(proj_drop, groups, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, n, 3 * local_heads * head_dim), n = tokens of this cp band
        B, n = qkv.shape[:2]
        qkv = qkv.reshape(B, n, 3, self.local_heads, self.head_dim)
        # one split, so the backward puts the q and k/v gradients together in one copy
        q, kv = qkv.split((1, 2), dim=2)
        q = q.squeeze(2).transpose(1, 2)  # (B, h, n, hd)
        # Padding tokens (after the band's real ones) are dropped from the keys and values, so no
        # query attends to them; their own queries give finite outputs that nothing uses.
        real = n if self.band_tokens is None else self.band_tokens[self.groups.cp_rank]
        assert real <= n, f"{n} tokens reached attention, fewer than the band's {real} real ones"
        kv = kv[:, :real]  # (B, real, 2, h, hd)
        # K/V of every cp band in band order, in one collective
        kv = all_gather_fwd_reduce_scatter_bwd(kv, self.groups.cp_group, dim=1, sizes=self.band_tokens)
        # (B, h, N, hd) views, split on kv's own dim 2: their gradients are stacked straight into
        # kv's layout (split on a permuted view, the stack would need a second copy)
        k, v = (t.transpose(1, 2) for t in kv.unbind(2))
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, n, self.local_heads * self.head_dim)
        return self.proj_drop(self.proj(x))


class ParallelBlock(nn.Module):
    """Pre-norm block ``x + attn(norm1(x))``, ``x + mlp(norm2(x))`` on the rank's own tokens
    (``N/(cp*tp)`` with sequence parallelism); its layers say what is split or replicated."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden_dim: int, groups: ParallelGroups,
                 drop: float = 0.0, eps: float = 1e-5, sequence_parallel: bool = True,
                 band_tokens: Optional[Sequence[int]] = None, dtype=None, device=None):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.norm1 = TokenShardedLayerNorm(dim, eps=eps, **kw)
        self.attn = ParallelAttention(dim, num_heads, groups, attn_drop=drop, proj_drop=drop,
                                      band_tokens=band_tokens, **kw)
        self.norm2 = TokenShardedLayerNorm(dim, eps=eps, **kw)
        self.mlp = ParallelMLP(dim, mlp_hidden_dim, groups, drop=drop, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ParallelPatchEmbed(PatchEmbed):
    """Patch embedding of the rank's band of whole patch rows, one band per chunk of
    ``band_axes`` (:func:`axes_index`): (B, C, band rows, W) -> (B, band tokens, E), a contiguous
    token range of the serial model. ``proj`` is whole, its gradient summed over ``reduce_over``
    (by default ``band_axes``: the ranks that see other bands)."""

    def __init__(self, img_size, patch_size: int, in_chans: int, embed_dim: int, groups: ParallelGroups,
                 band_axes: Sequence[str] = ("cp", "tp"), reduce_over: Optional[Sequence[str]] = None, dtype=None,
                 device=None):
        super().__init__(img_size, patch_size, in_chans, embed_dim)
        self.proj.to(dtype=dtype, device=device)
        self.band_axes = tuple(band_axes)
        chunks, index = axes_index(groups, self.band_axes)
        if chunks > self.grid[0]:
            names = " x ".join(f"{'context_parallel' if a == 'cp' else 'tensor_parallel'}={groups.size(a)}"
                               for a in self.band_axes)
            raise ValueError(f"{names} = {chunks} bands exceed the {self.grid[0]} patch rows "
                             f"(img height {img_size[0]} / patch_size {patch_size}): every band needs a "
                             f"whole patch row; use at most {self.grid[0]} bands")
        self.patch_size = patch_size
        self.rows = split_bounds(self.grid[0], chunks, index)  # this rank's patch rows [start, stop)
        self.local_grid = (self.rows[1] - self.rows[0], self.grid[1])
        self.local_num_patches = self.local_grid[0] * self.local_grid[1]
        mark_module_replicated(self.proj, self.band_axes if reduce_over is None else reduce_over)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        want = (self.local_grid[0] * p, self.local_grid[1] * p)
        if tuple(x.shape[-2:]) != want:
            raise ValueError(f"expected this rank's band of {want[0]} image rows x {want[1]} columns "
                             f"(use shard_image), got spatial shape {tuple(x.shape[-2:])}")
        return super().forward(x)  # (B, C, rows, W) -> (B, band tokens, E)
