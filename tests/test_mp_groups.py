"""Rank layout of the tp x cp x dp groups (pure functions, no processes) and its validation."""
import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed.groups import (SINGLE_PROCESS, ParallelGroups, build_groups, group_ranks, parse_order,  # noqa: E402
                                rank_coords, validate_parallel_config)

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp"))]


@pytest.mark.parametrize("order,expected", [
    ("tp-cp-dp", {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                  "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "mp": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    ("cp-tp-dp", {"cp": [[0, 1], [2, 3], [4, 5], [6, 7]], "tp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                  "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "mp": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    ("dp-tp-cp", {"dp": [[0, 1], [2, 3], [4, 5], [6, 7]], "tp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                  "cp": [[0, 4], [1, 5], [2, 6], [3, 7]], "mp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
    ("tp-dp-cp", {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                  "cp": [[0, 4], [1, 5], [2, 6], [3, 7]], "mp": [[0, 1, 4, 5], [2, 3, 6, 7]]}),
])
def test_known_layouts_world8(order, expected):
    assert group_ranks(8, 2, 2, order) == expected


def test_uneven_sizes_world12():
    # tp=2, cp=3, dp=2 with tp fastest, then cp
    g = group_ranks(12, 2, 3, "tp-cp-dp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert g["cp"] == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert g["dp"] == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert g["mp"] == [list(range(6)), list(range(6, 12))]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world,tp,cp", [(8, 2, 2), (12, 2, 3), (16, 4, 2), (6, 3, 1), (4, 1, 1), (1, 1, 1)])
def test_group_properties(order, world, tp, cp):
    dp = world // (tp * cp)
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    g = group_ranks(world, tp, cp, order)
    for axis, size in sizes.items():
        flat = sorted(r for grp in g[axis] for r in grp)
        assert flat == list(range(world)), f"{axis} groups must partition the ranks"
        assert all(len(grp) == size for grp in g[axis])
        for grp in g[axis]:  # members differ only in their coordinate along this axis, in order
            coords = [rank_coords(r, sizes, parse_order(order)) for r in grp]
            assert [c[axis] for c in coords] == list(range(size))
            assert all({k: v for k, v in c.items() if k != axis} ==
                       {k: v for k, v in coords[0].items() if k != axis} for c in coords)
    # the fastest axis has adjacent ranks
    first = parse_order(order)[0]
    assert g[first][0] == list(range(sizes[first]))
    # a tp group and a cp group share at most one rank; mp = tp x cp of one dp coordinate
    for a, b in itertools.combinations(("tp", "cp", "dp"), 2):
        for ga in g[a]:
            for gb in g[b]:
                assert len(set(ga) & set(gb)) <= 1
    assert all(len(grp) == tp * cp for grp in g["mp"])


def test_tp_cp_one_is_pure_data_parallel():
    g = group_ranks(4, 1, 1, "tp-cp-dp")
    assert g["dp"] == [[0, 1, 2, 3]]
    assert g["tp"] == [[0], [1], [2], [3]]
    assert validate_parallel_config(4) == (1, 1, 4, ("tp", "cp", "dp"))


def test_single_process_groups():
    pg = build_groups()  # no process group initialised
    assert isinstance(pg, ParallelGroups)
    assert (pg.world_size, pg.tp_size, pg.cp_size, pg.dp_size, pg.mp_rank) == (1, 1, 1, 1, 0)
    assert pg.size("cp") == 1 and pg.dp_ranks == [0]
    # not None, which torch.distributed reads as the default (world) group
    assert all(pg.group(a) is SINGLE_PROCESS for a in ("tp", "cp", "dp", "mp"))
    assert (SINGLE_PROCESS.size(), SINGLE_PROCESS.rank()) == (1, 0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, tensor_parallel=2, context_parallel=2),
     "tensor_parallel=2 x context_parallel=2 = 4 does not divide world size 6"),
    (dict(world_size=4, tensor_parallel=3, context_parallel=1),
     "tensor_parallel=3 x context_parallel=1 = 3 does not divide world size 4"),
    (dict(world_size=8, tensor_parallel=1, context_parallel=3),
     "tensor_parallel=1 x context_parallel=3 = 3 does not divide world size 8"),
    (dict(world_size=4, tensor_parallel=0), "tensor_parallel must be a positive integer, got 0"),
    (dict(world_size=4, context_parallel=-2), "context_parallel must be a positive integer, got -2"),
    (dict(world_size=4, parallel_order="tp-cp"), "must be a permutation of tp, cp and dp"),
    (dict(world_size=4, parallel_order="tp-tp-dp"), "must be a permutation of tp, cp and dp"),
    (dict(world_size=4, parallel_order="tp-cp-pp"), "must be a permutation of tp, cp and dp"),
])
def test_invalid_configs(kwargs, message):
    with pytest.raises(ValueError) as e:
        validate_parallel_config(**kwargs)
    assert message in str(e.value)
    with pytest.raises(ValueError):
        group_ranks(**kwargs)


def test_build_groups_needs_distributed_for_model_parallel():
    with pytest.raises(ValueError, match=r"tensor_parallel=2 x context_parallel=1 = 2 does not divide "
                       r"world size 1 .*: launch a multiple of 2 ranks, or make tensor_parallel x "
                       r"context_parallel a divisor of 1"):
        build_groups(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"world size 4 was requested but the process group has 1 rank\(s\)"):
        build_groups(4, 2, 2)
    assert build_groups(1, 1, 1, "dp-cp-tp").order == ("dp", "cp", "tp")


# ---- real process groups (DeviceMesh) agree with the pure layout; the rank harness -------------

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import RankError, run_ranks  # noqa: E402

MESH_CASES = [(2, 2, order) for order in ORDERS] + [(1, 1, "tp-cp-dp"), (4, 1, "cp-tp-dp"), (1, 2, "dp-cp-tp")]


def _build_all_layouts(scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    out = {"echo": (dist.get_rank(), dist.get_world_size(), t.item() * scale, torch.get_num_threads())}
    for tp, cp, order in MESH_CASES:
        g = build_groups(4, tp, cp, order)
        got = {}
        for name in ("tp", "cp", "dp", "mp"):
            grp = g.group(name)
            got[name] = (getattr(g, f"{name}_ranks"), dist.get_process_group_ranks(grp), g.rank_in(name),
                         dist.get_rank(grp))
        out[(tp, cp, order)] = (got, (g.tp_rank, g.cp_rank, g.dp_rank), g.mesh.mesh_dim_names)
    return out


def test_build_groups_matches_group_ranks():
    results = run_ranks(_build_all_layouts, 4, 10.0, timeout=120)
    # the harness: results in rank order, arguments passed, one thread per rank
    assert [res["echo"] for res in results] == [(r, 4, 60.0, 1) for r in range(4)]
    for rank, res in enumerate(results):
        for tp, cp, order in MESH_CASES:
            got, coords, dims = res[(tp, cp, order)]
            expected = group_ranks(4, tp, cp, order)
            sizes = {"tp": tp, "cp": cp, "dp": 4 // (tp * cp)}
            c = rank_coords(rank, sizes, parse_order(order))
            assert coords == (c["tp"], c["cp"], c["dp"])
            assert dims == tuple(reversed(parse_order(order)))
            for name in ("tp", "cp", "dp", "mp"):
                listed, actual, rank_in, actual_rank_in = got[name]
                mine = next(grp for grp in expected[name] if rank in grp)
                assert listed == mine and actual == mine, (rank, order, name, listed, actual, mine)
                assert rank_in == actual_rank_in == mine.index(rank) or name == "mp"


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("rank one is broken")
    dist.barrier()  # left waiting: the harness must stop it
    return "unreachable"


def _hang_on_rank_zero():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    return dist.get_rank()


def test_harness_propagates_rank_exception():
    with pytest.raises(RankError) as e:
        run_ranks(_fail_on_rank_one, 2, timeout=60)
    msg = str(e.value)
    assert "rank 1 of 2 failed" in msg and "KeyError" in msg and "rank one is broken" in msg
    assert "_fail_on_rank_one" in msg  # the rank's traceback


def test_harness_times_out_instead_of_hanging():
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] of 2 did not finish"):
        run_ranks(_hang_on_rank_zero, 2, timeout=8)


def _collective_past_a_stalled_rank(timeout_s, stall_s):
    """tp = cp = 2 on 4 ranks (tp groups [0, 1], [2, 3]; cp [0, 2], [1, 3]; mp all four): rank 1
    stalls, and each other rank waits on it in another kind of group. What each saw, and when."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    g = build_groups(4, 2, 2, "tp-cp-dp", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(stall_s)
        return "stalled", stall_s
    name = {0: "tp", 2: "mp", 3: "cp"}[rank]  # tp and cp from the DeviceMesh, mp from new_group
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=g.group(name))
        return name, "returned"
    except RuntimeError:
        return name, time.monotonic() - t0


def test_a_stalled_rank_times_out_the_model_parallel_groups_at_the_given_timeout():
    """Every group the model-parallel layout makes waits ``timeout`` for a rank (dist_timeout_s
    in a run), not torch's default for a new group (30 minutes with gloo)."""
    results = run_ranks(_collective_past_a_stalled_rank, 4, 2.0, 14.0, timeout=90, pg_timeout=60)
    assert results[1] == ("stalled", 14.0)
    for rank, name in ((0, "tp"), (2, "mp"), (3, "cp")):
        got, waited = results[rank]
        assert got == name and waited != "returned" and 1.5 < waited < 10.0, (rank, results)


NCCL_GROUPS = """
import datetime, os, torch, torch.distributed as dist
from distributed.groups import build_groups
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
timeout = datetime.timedelta(seconds=42)
dist.init_process_group("nccl", rank=0, world_size=1, timeout=timeout,
                        device_id=torch.device("cuda", 0))
g = build_groups(1, 1, 1, timeout=timeout)
for name in ("tp", "cp", "dp", "mp"):
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t, group=g.group(name))
    assert t.item() == 1.0, (name, t)
dist.destroy_process_group()
print("groups ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_the_groups_timeout_reaches_nccl_groups_as_a_run_makes_them():
    """On NCCL (the default group bound to its GPU, as a run makes it) the mesh's groups take the
    timeout through NCCL's own options: made and used without error."""
    import subprocess

    from distributed_harness import find_free_port
    env = dict(os.environ, PORT=str(find_free_port()),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", NCCL_GROUPS], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "groups ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
