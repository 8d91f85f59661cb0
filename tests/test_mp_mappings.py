"""Forward and backward of every mapping in ``distributed.mappings`` against its definition.

Four gloo ranks are spawned once; groups of size 2 (the tp groups of a tp=2 layout) and 4 (all
ranks) are tested, along dims 0, 1 and -1. Each rank's input is a known function of its rank, so
every rank can build the expected result from all inputs. Backward uses the loss
``sum_r <y_r, w_r>`` with per-rank weights ``w_r``. float64; tolerance rtol 1e-12, atol 1e-12
(only the summation order differs).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import run_ranks  # noqa: E402

MAPPINGS = ["copy_to", "reduce_from", "scatter_to", "gather_from", "all_gather", "reduce_scatter"]
GROUP_SIZES = [2, 4]
DIMS = [0, 1, -1]
CASES = [(m, n, d) for m in MAPPINGS for n in GROUP_SIZES
         for d in ([0] if m in ("copy_to", "reduce_from") else DIMS)]  # those two have no dim
SHAPE = (4, 8, 12)  # divisible by 2 and 4 along every dim
TOL = dict(rtol=1e-12, atol=1e-12)


def _tensor(tag, r):
    g = torch.Generator().manual_seed(1000 * tag + r)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64)


def _chunk(t, dim, n, r):
    return t.chunk(n, dim)[r]


def _out_shape(name, n, dim):
    shape = list(SHAPE)
    if name in ("scatter_to", "reduce_scatter"):
        shape[dim] //= n
    elif name in ("gather_from", "all_gather"):
        shape[dim] *= n
    return tuple(shape)


def _weight(name, n, dim, r):
    """Backward weight ``w_r`` (shaped like ``y_r``) of group rank ``r``."""
    g = torch.Generator().manual_seed(2000 + r)
    return torch.randn(_out_shape(name, n, dim), generator=g, dtype=torch.float64)


def _expected(name, n, dim, r):
    """(y_r, grad of x_r) from the mapping's definition."""
    xs = [_tensor(1, s) for s in range(n)]
    ws = [_weight(name, n, dim, s) for s in range(n)]
    if name == "copy_to":  # fwd identity, bwd all-reduce
        return xs[r], sum(ws)
    if name == "reduce_from":  # fwd all-reduce, bwd identity
        return sum(xs), ws[r]
    if name == "scatter_to":  # fwd split (own chunk), bwd all-gather
        return _chunk(xs[r], dim, n, r), torch.cat(ws, dim)
    if name == "gather_from":  # fwd all-gather, bwd split (own chunk)
        return torch.cat(xs, dim), _chunk(ws[r], dim, n, r)
    if name == "all_gather":  # fwd all-gather, bwd reduce-scatter
        return torch.cat(xs, dim), sum(_chunk(w, dim, n, r) for w in ws)
    assert name == "reduce_scatter"  # fwd reduce-scatter, bwd all-gather
    return _chunk(sum(xs), dim, n, r), torch.cat(ws, dim)


def _rank_main():
    import torch.distributed as dist

    from distributed import mappings
    from distributed.groups import build_groups

    pg2 = build_groups(tensor_parallel=2, context_parallel=1)  # tp groups [0,1], [2,3]
    pg4 = build_groups(tensor_parallel=4, context_parallel=1)
    groups = {2: pg2.tp_group, 4: pg4.tp_group}
    out = {}
    for name, n, dim in CASES:
        group = groups[n]
        r = dist.get_rank(group)
        x = _tensor(1, r).requires_grad_(True)
        fn = getattr(mappings, name)
        y = fn(x, group) if name in ("copy_to", "reduce_from") else fn(x, group, dim)
        w = _weight(name, n, dim, r)
        (y * w).sum().backward()
        out[(name, n, dim)] = (y.detach(), x.grad.clone(), r)

    # The gloo fallbacks (all-reduce + split, list all-gather) give the same results.
    x = _tensor(3, pg4.tp_rank)
    extra = {
        "rs_fallback": (mappings._reduce_scatter_via_all_reduce(x, pg4.tp_group, 1),
                        mappings.reduce_scatter_along(x, pg4.tp_group, 1)),
    }
    mappings._UNSUPPORTED.add("gloo")
    try:
        extra["ag_fallback"] = (mappings.all_gather_along(x, pg4.tp_group, 2),
                                torch.cat([_tensor(3, s) for s in range(4)], 2))
        extra["rs_fallback_forced"] = (mappings.reduce_scatter_along(x, pg4.tp_group, 2),
                                       _chunk(sum(_tensor(3, s) for s in range(4)), 2, 4, pg4.tp_rank))
    finally:
        mappings._UNSUPPORTED.discard("gloo")
    # None and size-1 groups are the identity; uneven sizes are rejected.
    extra["none_identity"] = (mappings.all_gather(x, None, 0), x)
    try:
        mappings.reduce_scatter(torch.ones(3, 2), pg4.tp_group, 0)
        extra["uneven"] = "no error"
    except ValueError as e:
        extra["uneven"] = str(e)
    return out, extra


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_rank_main, 4, timeout=120)


@pytest.mark.parametrize("name,n,dim", CASES, ids=[f"{m}-group{n}-dim{d}" for m, n, d in CASES])
def test_mapping_forward_backward(rank_results, name, n, dim):
    for res, _ in rank_results:
        y, gx, r = res[(name, n, dim)]
        ey, eg = _expected(name, n, dim, r)
        torch.testing.assert_close(y, ey, **TOL, msg=lambda m: f"forward of {name} (rank {r}): {m}")
        torch.testing.assert_close(gx, eg, **TOL, msg=lambda m: f"backward of {name} (rank {r}): {m}")


def test_fallbacks_and_edge_cases(rank_results):
    for _, extra in rank_results:
        for key in ("rs_fallback", "ag_fallback", "rs_fallback_forced", "none_identity"):
            got, want = extra[key]
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{key}: {m}")
        assert "not divisible by the group size 4" in extra["uneven"]
