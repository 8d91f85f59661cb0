"""Forward and backward of every mapping in ``distributed.mappings`` against its definition.

Four gloo ranks are spawned once; groups of size 2 (the tp groups of a tp=2 layout) and 4 (all
ranks) are tested, along dims 0, 1 and -1. Each rank's input is a known function of its rank, so
every rank can build the expected result from all inputs. Backward uses the loss
``sum_r <y_r, w_r>`` with per-rank weights ``w_r``. float64; tolerance rtol 1e-12, atol 1e-12
(only the summation order differs).

The two all-gathers are also run on chunks of different lengths (``sizes``, e.g. 3, 2, 2, 1:
padded for the collective, padding dropped), forward and backward. ``None`` is torch's default
group (all four ranks), so the mappings communicate over it; ``SINGLE_PROCESS`` is the identity.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import run_ranks  # noqa: E402

MAPPINGS = ["identity_fwd_all_reduce_bwd", "all_reduce_fwd_identity_bwd", "all_gather_fwd_split_bwd",
            "all_gather_fwd_reduce_scatter_bwd", "reduce_scatter_fwd_all_gather_bwd"]
NO_DIM = ("identity_fwd_all_reduce_bwd", "all_reduce_fwd_identity_bwd")
GROUP_SIZES = [2, 4]
DIMS = [0, 1, -1]
CASES = [(m, n, d) for m in MAPPINGS for n in GROUP_SIZES for d in ([0] if m in NO_DIM else DIMS)]
SHAPE = (4, 8, 12)  # divisible by 2 and 4 along every dim
UNEVEN = {2: (3, 1), 4: (3, 2, 2, 1)}  # chunk lengths along the gathered dim, per group size
GATHERS = ["all_gather_fwd_split_bwd", "all_gather_fwd_reduce_scatter_bwd"]
UNEVEN_CASES = [(m, n, d) for m in GATHERS for n in GROUP_SIZES for d in (1, -1)]
TOL = dict(rtol=1e-12, atol=1e-12)


def _tensor(tag, r, shape=SHAPE):
    g = torch.Generator().manual_seed(1000 * tag + r)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _uneven_shape(n, dim, r):
    shape = list(SHAPE)
    shape[dim] = UNEVEN[n][r]
    return tuple(shape)


def _chunk(t, dim, n, r):
    return t.chunk(n, dim)[r]


def _out_shape(name, n, dim):
    shape = list(SHAPE)
    if name == "reduce_scatter_fwd_all_gather_bwd":
        shape[dim] //= n
    elif name in GATHERS:
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
    if name == "identity_fwd_all_reduce_bwd":
        return xs[r], sum(ws)
    if name == "all_reduce_fwd_identity_bwd":
        return sum(xs), ws[r]
    if name == "all_gather_fwd_split_bwd":  # bwd: own chunk
        return torch.cat(xs, dim), _chunk(ws[r], dim, n, r)
    if name == "all_gather_fwd_reduce_scatter_bwd":  # bwd: sum of the own chunks
        return torch.cat(xs, dim), sum(_chunk(w, dim, n, r) for w in ws)
    assert name == "reduce_scatter_fwd_all_gather_bwd"
    return _chunk(sum(xs), dim, n, r), torch.cat(ws, dim)


def _uneven_weight(n, dim, r):
    shape = list(SHAPE)
    shape[dim] = sum(UNEVEN[n])
    g = torch.Generator().manual_seed(3000 + r)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _uneven_expected(name, n, dim, r):
    """(y_r, grad of x_r) of a gather of chunks of lengths ``UNEVEN[n]``."""
    xs = [_tensor(4, s, _uneven_shape(n, dim, s)) for s in range(n)]
    ws = [_uneven_weight(n, dim, s) for s in range(n)]
    own = [w.split(list(UNEVEN[n]), dim)[r] for w in ws]  # rank r's chunk of each rank's weight
    if name == "all_gather_fwd_split_bwd":
        return torch.cat(xs, dim), own[r]
    return torch.cat(xs, dim), sum(own)


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
        y = fn(x, group) if name in NO_DIM else fn(x, group, dim)
        w = _weight(name, n, dim, r)
        (y * w).sum().backward()
        out[(name, n, dim)] = (y.detach(), x.grad.clone(), r)
    for name, n, dim in UNEVEN_CASES:
        group = groups[n]
        r = dist.get_rank(group)
        x = _tensor(4, r, _uneven_shape(n, dim, r)).requires_grad_(True)
        y = getattr(mappings, name)(x, group, dim, sizes=UNEVEN[n])
        (y * _uneven_weight(n, dim, r)).sum().backward()
        plain = mappings.all_gather_along(x.detach(), group, dim, UNEVEN[n])
        out[("uneven", name, n, dim)] = (y.detach(), x.grad.clone(), r, plain)

    x = _tensor(3, pg4.tp_rank)
    extra = {}
    # None is the default group (all four ranks), as in torch.distributed: it communicates.
    rank = dist.get_rank()
    xw = torch.full((2,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = mappings.identity_fwd_all_reduce_bwd(xw, None)
    (y * (rank + 1)).sum().backward()
    extra["default group forward"] = (mappings.all_reduce_fwd_identity_bwd(xw.detach(), None),
                                      torch.full((2,), 10.0, dtype=torch.float64))
    extra["default group backward"] = (xw.grad, torch.full((2,), 10.0, dtype=torch.float64))
    extra["default group gather"] = (mappings.all_gather_fwd_split_bwd(x, None, 0),
                                     torch.cat([_tensor(3, s) for s in range(4)], 0))  # x of rank s
    # SINGLE_PROCESS (and any size-1 group) is the identity, without communication.
    from distributed.groups import SINGLE_PROCESS

    extra["single process identity"] = (mappings.all_gather_fwd_reduce_scatter_bwd(x, SINGLE_PROCESS, 0), x)
    extra["single process sum"] = (mappings.all_reduce_fwd_identity_bwd(x, SINGLE_PROCESS), x)
    extra["sizes"] = (mappings.group_size(None), mappings.group_size(SINGLE_PROCESS), mappings.group_size(pg2.tp_group))
    # sizes must divide; uneven gathers must say every rank's length
    try:
        mappings.reduce_scatter_fwd_all_gather_bwd(torch.ones(3, 2), pg4.tp_group, 0)
        extra["uneven"] = "no error"
    except ValueError as e:
        extra["uneven"] = str(e)
    try:
        mappings.all_gather_fwd_split_bwd(torch.ones(3, 2), pg4.tp_group, 0, sizes=(1, 2, 1, 2))
        extra["wrong sizes"] = "no error"
    except ValueError as e:
        extra["wrong sizes"] = str(e)
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


@pytest.mark.parametrize("name,n,dim", UNEVEN_CASES, ids=[f"{m}-group{n}-dim{d}" for m, n, d in UNEVEN_CASES])
def test_gather_of_uneven_chunks(rank_results, name, n, dim):
    for res, _ in rank_results:
        y, gx, r, plain = res[("uneven", name, n, dim)]
        ey, eg = _uneven_expected(name, n, dim, r)
        torch.testing.assert_close(y, ey, **TOL, msg=lambda m: f"forward of {name} (rank {r}): {m}")
        torch.testing.assert_close(plain, ey, **TOL, msg=lambda m: f"all_gather_along (rank {r}): {m}")
        torch.testing.assert_close(gx, eg, **TOL, msg=lambda m: f"backward of {name} (rank {r}): {m}")


def test_edge_cases(rank_results):
    for _, extra in rank_results:
        for key in ("single process identity",
                    "single process sum", "default group forward", "default group backward",
                    "default group gather"):
            got, want = extra[key]
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{key}: {m}")
        assert extra["sizes"] == (4, 1, 2)
        assert "not divisible by the group size 4" in extra["uneven"]
        assert "sizes=[1, 2, 1, 2] must give the length of every rank's chunk" in extra["wrong sizes"]
