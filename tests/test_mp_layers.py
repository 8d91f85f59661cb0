"""Every sharded layer equals its serial layer: output, input gradient and weight gradients.

Four gloo ranks are spawned once and run all cases: layouts tp=2 x cp=2, tp=4, cp=4 and
tp=2 x dp=2 (order dp-tp-cp), each with and without sequence parallelism. The serial layer and
the parallel one share weights (``load_serial_state_dict``); each rank feeds its slice of the same input
and backpropagates its slice of the same output gradient ``G`` (loss ``<y, G>``). Weight
gradients are reduced with ``reduce_replicated_grad_shards`` and gathered to the serial layout.

Tolerances: float64 rtol 1e-10, atol 1e-12; float32 rtol 1e-4, atol 1e-5.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import run_ranks  # noqa: E402

LAYOUTS = {  # name: (tensor_parallel, context_parallel, parallel_order)
    "tp2-cp2": (2, 2, "tp-cp-dp"),
    "tp4": (4, 1, "tp-cp-dp"),
    "cp4": (1, 4, "cp-tp-dp"),
    "tp2-dp2": (2, 1, "dp-tp-cp"),
}
LAYERS = ["column", "column_stacked", "row", "mlp", "attention", "layernorm", "block", "patch_embed"]
CASES = [(lay, sp, layer) for lay in LAYOUTS for sp in (True, False) for layer in LAYERS]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=1e-4, atol=1e-5)}

B, N, E, HEADS, HIDDEN = 2, 16, 16, 4, 32
IMG, PATCH, CIN = (16, 8), 2, 3  # 8 patch rows of 4 patches


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return module


def _rand(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _rank_main():
    import torch.nn as nn

    from distributed.groups import build_groups
    from distributed.layers import (ColumnParallelLinear, ParallelAttention, ParallelBlock, ParallelMLP,
                                    ParallelPatchEmbed, RowParallelLinear, TokenShardedLayerNorm,
                                    load_serial_state_dict, reduce_replicated_grad_shards, serial_state_dict)
    from networks.vit import MLP, Attention, Block, PatchEmbed

    results = {}
    for lay_name, (tp, cp, order) in LAYOUTS.items():
        groups = build_groups(4, tp, cp, order)

        def chunk(t, dim, n, i):
            return t.chunk(n, dim)[i].contiguous()

        for sp in (True, False):
            n_tok = cp * tp if sp else cp
            i_tok = groups.mp_rank if sp else groups.cp_rank

            def tokens(t):  # token-sharded region (between blocks)
                return chunk(t, 1, n_tok, i_tok)

            def cp_tokens(t):  # all tokens of this cp rank (inside attention / MLP)
                return chunk(t, 1, cp, groups.cp_rank)

            def features(t, stacked=1):  # last dim split over tp, per stacked block
                blocks = t.chunk(stacked, -1)
                return torch.cat([chunk(b, -1, tp, groups.tp_rank) for b in blocks], -1)

            for layer in LAYERS:
                for dname, dtype in DTYPES.items():
                    seed = 100 * LAYERS.index(layer) + 10 * list(DTYPES).index(dname)
                    kw = dict(sequence_parallel=sp)
                    if layer == "column" or layer == "column_stacked":
                        stacked = 3 if layer == "column_stacked" else 1
                        serial = nn.Linear(E, 3 * E if stacked == 3 else HIDDEN)
                        par_fn = lambda m: ColumnParallelLinear(E, m.out_features, groups, stacked=stacked, **kw)  # noqa
                        xshape = (B, N, E)
                        in_slice, out_slice = tokens, lambda t: features(cp_tokens(t), stacked)
                    elif layer == "row":
                        serial = nn.Linear(HIDDEN, E)
                        par_fn = lambda m: RowParallelLinear(HIDDEN, E, groups, **kw)  # noqa
                        xshape = (B, N, HIDDEN)
                        in_slice, out_slice = lambda t: features(cp_tokens(t)), tokens
                    elif layer == "mlp":
                        serial = MLP(E, HIDDEN)
                        par_fn = lambda m: ParallelMLP(E, HIDDEN, groups, **kw)  # noqa
                        xshape, in_slice, out_slice = (B, N, E), tokens, tokens
                    elif layer == "attention":
                        serial = Attention(E, HEADS)
                        par_fn = lambda m: ParallelAttention(E, HEADS, groups, **kw)  # noqa
                        xshape, in_slice, out_slice = (B, N, E), tokens, tokens
                    elif layer == "layernorm":
                        serial = nn.LayerNorm(E)
                        par_fn = lambda m: TokenShardedLayerNorm(E, **kw)  # noqa
                        xshape, in_slice, out_slice = (B, N, E), tokens, tokens
                    elif layer == "block":
                        serial = Block(E, HEADS, mlp_ratio=HIDDEN / E)
                        par_fn = lambda m: ParallelBlock(E, HEADS, HIDDEN, groups, eps=1e-6, **kw)  # noqa
                        xshape, in_slice, out_slice = (B, N, E), tokens, tokens
                    else:  # patch_embed: the rank's band of image rows -> its tokens
                        serial = PatchEmbed(IMG, PATCH, CIN, E)
                        par_fn = lambda m: ParallelPatchEmbed(  # noqa
                            IMG, PATCH, CIN, E, groups, band_axes=("cp", "tp") if sp else ("cp",))
                        xshape = (B, CIN) + IMG
                        in_slice, out_slice = (lambda t: chunk(t, 2, n_tok, i_tok)), tokens
                    serial = _randomize(serial, seed).to(dtype)
                    par = par_fn(serial).to(dtype)  # the serial layer's weights, sliced:
                    load_serial_state_dict(par, serial.state_dict(), groups)
                    # the layer holds exactly the serial weights
                    same = serial_state_dict(par, groups)
                    X = _rand(xshape, seed + 1, dtype).requires_grad_(True)
                    Y = serial(X)
                    G = _rand(Y.shape, seed + 2, dtype)
                    (Y * G).sum().backward()
                    x = in_slice(X.detach()).requires_grad_(True)
                    y = par(x)
                    (y * out_slice(G)).sum().backward()
                    reduce_replicated_grad_shards(par, groups, average_dp=True)
                    grads = serial_state_dict(par, groups, grads=True)
                    res = {"output": (y.detach(), out_slice(Y.detach())),
                           "input grad": (x.grad, in_slice(X.grad))}
                    for name, p in serial.named_parameters():
                        res[f"weight {name}"] = (same[name], p.detach())
                        res[f"grad {name}"] = (grads[name], p.grad)
                    results[(lay_name, sp, layer, dname)] = res
        if tp > 1:
            results[(lay_name, "bf16")] = _column_under_autocast(groups, tp, cp)
    return results


def _column_under_autocast(groups, tp, cp):
    """A sequence-parallel column linear under CPU bf16 autocast against the serial linear: the
    input it keeps for backward is bf16 (cast before the save and the gather), its input gradient
    float32 like its input, and output and gradients match within bf16 rounding."""
    import torch.nn as nn

    from distributed.layers import (ColumnParallelLinear, load_serial_state_dict, reduce_replicated_grad_shards,
                                    serial_state_dict)

    serial = _randomize(nn.Linear(E, HIDDEN), 7)
    par = ColumnParallelLinear(E, HIDDEN, groups, sequence_parallel=True)
    load_serial_state_dict(par, serial.state_dict(), groups)
    X = _rand((B, N, E), 8, torch.float32).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Y = serial(X)
    G = _rand(Y.shape, 9, torch.float32)
    (Y.float() * G).sum().backward()
    x = X.detach().chunk(cp * tp, 1)[groups.mp_rank].contiguous().requires_grad_(True)
    saved = []
    params = {p.data_ptr() for p in par.parameters()}

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        y = par(x)
    g_out = G.chunk(cp, 1)[groups.cp_rank].chunk(tp, -1)[groups.tp_rank]
    (y.float() * g_out).sum().backward()
    reduce_replicated_grad_shards(par, groups, average_dp=True)
    grads = serial_state_dict(par, groups, grads=True)
    return {"saved dtypes": saved, "output dtype": str(y.dtype), "input grad dtype": str(x.grad.dtype),
            "output": (y.float(), Y.detach().float().chunk(cp, 1)[groups.cp_rank].chunk(tp, -1)[groups.tp_rank]),
            "input grad": (x.grad, X.grad.chunk(cp * tp, 1)[groups.mp_rank]),
            "grad weight": (grads["weight"], serial.weight.grad), "grad bias": (grads["bias"], serial.bias.grad)}


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_rank_main, 4, timeout=150)


@pytest.mark.parametrize("layout,sp,layer", CASES,
                         ids=[f"{lay}-{'sp' if sp else 'nosp'}-{layer}" for lay, sp, layer in CASES])
def test_layer_matches_serial(rank_results, layout, sp, layer):
    for rank, res in enumerate(rank_results):
        for dname in DTYPES:
            for what, (got, want) in res[(layout, sp, layer, dname)].items():
                assert got.shape == want.shape, f"rank {rank} {dname} {what}: {got.shape} vs {want.shape}"
                torch.testing.assert_close(got, want, **TOL[dname],
                                           msg=lambda m: f"rank {rank} {dname} {what}: {m}")


@pytest.mark.parametrize("layout", [lay for lay, (tp, _, _) in LAYOUTS.items() if tp > 1])
def test_column_linear_under_bf16_autocast(rank_results, layout):
    """Tolerance: bf16 rounding (8 bits of mantissa) of results and of partial sums (the sharded
    weight gradient is summed from per-rank bf16 products): rtol 1.6e-2, atol 2% of the largest
    magnitude of the tensor."""
    for rank, res in enumerate(rank_results):
        r = res[(layout, "bf16")]
        assert r["saved dtypes"] == ["torch.bfloat16"], f"rank {rank}: keeps {r['saved dtypes']} for backward"
        assert (r["output dtype"], r["input grad dtype"]) == ("torch.bfloat16", "torch.float32")
        for what in ("output", "input grad", "grad weight", "grad bias"):
            got, want = r[what]
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=0.02 * want.abs().max().item(),
                                       msg=lambda m: f"rank {rank} {what}: {m}")


def test_replicated_markers():
    """Which parameters are replicated over which axes (no processes needed)."""
    from distributed.groups import ParallelGroups
    from distributed.layers import ParallelBlock, ParallelPatchEmbed

    g = ParallelGroups(tensor_parallel=2, context_parallel=2, data_parallel=1, world_size=4)
    blk = ParallelBlock(E, HEADS, HIDDEN, g)
    marks = {n: p.reduce_over for n, p in blk.named_parameters()}
    assert marks == {
        "norm1.weight": ("cp", "tp"), "norm1.bias": ("cp", "tp"),
        "attn.qkv.weight": ("cp",), "attn.qkv.bias": ("cp",),
        "attn.proj.weight": ("cp",), "attn.proj.bias": ("cp", "tp"),
        "norm2.weight": ("cp", "tp"), "norm2.bias": ("cp", "tp"),
        "mlp.fc1.weight": ("cp",), "mlp.fc1.bias": ("cp",),
        "mlp.fc2.weight": ("cp",), "mlp.fc2.bias": ("cp", "tp"),
    }
    shapes = {n: tuple(p.shape) for n, p in blk.named_parameters()}
    assert shapes["attn.qkv.weight"] == (3 * E // 2, E) and shapes["attn.proj.weight"] == (E, E // 2)
    assert shapes["mlp.fc1.weight"] == (HIDDEN // 2, E) and shapes["mlp.fc2.weight"] == (E, HIDDEN // 2)
    nosp = ParallelBlock(E, HEADS, HIDDEN, g, sequence_parallel=False)
    assert nosp.norm1.weight.reduce_over == ("cp",) and nosp.attn.proj.bias.reduce_over == ("cp",)
    pe = ParallelPatchEmbed(IMG, PATCH, CIN, E, g)
    assert pe.proj.weight.reduce_over == ("cp", "tp") and pe.local_grid == (2, 4)
    assert ParallelPatchEmbed(IMG, PATCH, CIN, E, g, band_axes=("cp",)).proj.weight.reduce_over == ("cp",)


def test_uneven_bands_and_shard_spec():
    """Bands of whole patch rows differ by at most one row, longer first; a ``ShardSpec`` with a
    ``unit`` cuts the same way and its chunks put together give the serial tensor back (no
    processes needed: ``shard`` is local)."""
    from distributed.groups import ParallelGroups
    from distributed.layers import ParallelPatchEmbed, ShardSpec, split_bounds

    assert [split_bounds(45, 4, i) for i in range(4)] == [(0, 12), (12, 23), (23, 34), (34, 45)]
    assert [split_bounds(8, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    cols, rows = 3, 5
    full = torch.arange(rows * cols * 2, dtype=torch.float64).reshape(1, rows * cols, 2)
    spec = ShardSpec(tuple(full.shape), ("cp",), 1, unit=cols)
    parts, bands = [], []
    for c in range(4):
        g = ParallelGroups(tensor_parallel=1, context_parallel=4, world_size=4, cp_rank=c)
        pe = ParallelPatchEmbed((rows * PATCH, cols * PATCH), PATCH, CIN, E, g, band_axes=("cp",))
        bands.append(pe.rows)
        part = spec.shard(full, g)
        assert tuple(part.shape) == (1, (pe.rows[1] - pe.rows[0]) * cols, 2)
        parts.append(part)
    assert bands == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert torch.equal(torch.cat(parts, 1), full)
    with pytest.raises(ValueError, match="context_parallel=4 = 4 bands exceed the 3 patch rows"):
        ParallelPatchEmbed((3 * PATCH, 8), PATCH, CIN, E, ParallelGroups(context_parallel=4, world_size=4),
                           band_axes=("cp",))
