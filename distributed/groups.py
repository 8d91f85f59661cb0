"""Process groups for tensor (tp), context (cp) and data (dp) parallelism: the ``world_size``
ranks form a tp x cp x dp grid (``dp = world_size / (tp * cp)``), ``parallel_order`` naming the
axes from fastest to slowest varying rank (docs/parallelism.md, "How model parallelism works")::

    rank = c[order[0]] + size[order[0]] * (c[order[1]] + size[order[1]] * c[order[2]])

The ``tp``, ``cp`` and ``dp`` groups are the ranks that differ only in that coordinate; ``mp``
is the tp x cp ranks of one model replica. ``group_ranks`` computes the rank lists without any
process group; ``build_groups`` creates them in one ``ParallelGroups`` that layers receive.
Without torch.distributed every group is :data:`SINGLE_PROCESS`, over which every collective is
the identity (``None`` means the default group, as in torch.distributed).
"""
import datetime
import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

AXES = ("tp", "cp", "dp")


class SingleProcessGroup:
    """The group of this process alone, without torch.distributed: size 1, rank 0. Collectives
    over it (``distributed.mappings``) return their input and never call torch.distributed."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SINGLE_PROCESS"


SINGLE_PROCESS = SingleProcessGroup()
Group = Union[dist.ProcessGroup, SingleProcessGroup]


def parse_order(parallel_order: Union[str, Sequence[str]]) -> Tuple[str, str, str]:
    """``"tp-cp-dp"`` (or a sequence of the names) -> ``("tp", "cp", "dp")``, validated."""
    if isinstance(parallel_order, str):
        names = tuple(s.strip().lower() for s in parallel_order.split("-"))
    else:
        names = tuple(str(s).strip().lower() for s in parallel_order)
    if sorted(names) != sorted(AXES):
        raise ValueError(
            f"parallel_order={parallel_order!r} must be a permutation of tp, cp and dp joined by '-', "
            f"e.g. 'tp-cp-dp' (tp ranks adjacent) or 'cp-tp-dp'")
    return names


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def validate_parallel_config(world_size: int, tensor_parallel: int = 1, context_parallel: int = 1,
                             parallel_order: Union[str, Sequence[str]] = "tp-cp-dp"):
    """Check a layout and return ``(tp, cp, dp, order)``; ``dp = world_size // (tp * cp)``."""
    world_size = _check_positive("world size", world_size)
    tp = _check_positive("tensor_parallel", tensor_parallel)
    cp = _check_positive("context_parallel", context_parallel)
    order = parse_order(parallel_order)
    if world_size % (tp * cp):
        raise ValueError(
            f"tensor_parallel={tp} x context_parallel={cp} = {tp * cp} does not divide world size "
            f"{world_size} (the data parallel size is world size / (tensor_parallel x "
            f"context_parallel)): launch a multiple of {tp * cp} ranks, or make tensor_parallel x "
            f"context_parallel a divisor of {world_size}")
    return tp, cp, world_size // (tp * cp), order


def rank_coords(rank: int, sizes: Dict[str, int], order: Sequence[str]) -> Dict[str, int]:
    """Coordinates ``{"tp": i, "cp": j, "dp": k}`` of ``rank`` (``order[0]`` varies fastest)."""
    coords = {}
    for name in order:
        coords[name] = rank % sizes[name]
        rank //= sizes[name]
    return coords


def group_ranks(world_size: int, tensor_parallel: int = 1, context_parallel: int = 1,
                parallel_order: Union[str, Sequence[str]] = "tp-cp-dp") -> Dict[str, List[List[int]]]:
    """``{"tp": [...], "cp": [...], "dp": [...], "mp": [...]}``: every group of each kind (sorted
    by first rank), each in ascending rank, without creating process groups; e.g.
    ``group_ranks(8, 2, 2, "tp-cp-dp")["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]``."""
    tp, cp, dp, order = validate_parallel_config(world_size, tensor_parallel, context_parallel,
                                                 parallel_order)
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    out = {}
    for name, varying in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("mp", ("tp", "cp"))):
        groups = {}  # the ranks of a group agree on the coordinates that do not vary in it
        for rank in range(world_size):  # ascending, so each group is too
            c = rank_coords(rank, sizes, order)
            groups.setdefault(tuple(c[a] for a in AXES if a not in varying), []).append(rank)
        out[name] = sorted(groups.values())
    return out


@dataclass
class ParallelGroups:
    """Sizes, coordinates, rank lists and process groups (:data:`SINGLE_PROCESS` without
    torch.distributed) of one rank in the tp x cp x dp grid. ``group(name)``, ``size(name)`` and
    ``rank_in(name)`` accept ``"tp"``, ``"cp"``, ``"dp"`` and ``"mp"``."""

    tensor_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1
    order: Tuple[str, str, str] = ("tp", "cp", "dp")
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    tp_ranks: List[int] = field(default_factory=lambda: [0])
    cp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks: List[int] = field(default_factory=lambda: [0])
    mp_ranks: List[int] = field(default_factory=lambda: [0])
    tp_group: Group = SINGLE_PROCESS
    cp_group: Group = SINGLE_PROCESS
    dp_group: Group = SINGLE_PROCESS
    mp_group: Group = SINGLE_PROCESS
    mesh: Optional[object] = None  # torch.distributed.device_mesh.DeviceMesh with dims named tp/cp/dp

    # ---- convenient aliases -------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.tensor_parallel

    @property
    def cp_size(self) -> int:
        return self.context_parallel

    @property
    def dp_size(self) -> int:
        return self.data_parallel

    @property
    def mp_size(self) -> int:
        return self.tensor_parallel * self.context_parallel

    @property
    def mp_rank(self) -> int:
        """Position of this rank's token/image-row chunk among the ``cp * tp`` chunks."""
        return self.cp_rank * self.tensor_parallel + self.tp_rank

    # ---- lookup by axis name ---------------------------------------------------------------
    def group(self, name: str) -> Group:
        return getattr(self, f"{name}_group")

    def size(self, name: str) -> int:
        return getattr(self, f"{name}_size")

    def rank_in(self, name: str) -> int:
        return getattr(self, f"{name}_rank")

    def __deepcopy__(self, memo):
        return self  # process groups are shared handles; copies of a model (e.g. an EMA) share them

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} {self.tp_ranks}, "
                f"cp {self.cp_rank}/{self.cp_size} {self.cp_ranks}, dp {self.dp_rank}/{self.dp_size} "
                f"{self.dp_ranks} (order {'-'.join(self.order)})")


def _mesh_timeout(dims: Sequence[str], timeout: Optional[datetime.timedelta]) -> dict:
    """``init_device_mesh``'s keyword that gives the groups of each of ``dims`` ``timeout``: its
    ``backend_override`` (torch 2.9 on; before, the mesh's groups keep torch's default), with
    options of the default group's backend."""
    if timeout is None or "backend_override" not in inspect.signature(init_device_mesh).parameters:
        return {}
    backend = dist.get_backend()

    def options():  # one per dimension: creating a group writes into its options
        if backend == "nccl":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            return nccl
        return dist.ProcessGroupGloo.Options(backend, timeout)  # (the base class's: backend, timeout)
    return {"backend_override": {d: options() for d in dims}}


def build_groups(world_size: Optional[int] = None, tensor_parallel: int = 1, context_parallel: int = 1,
                 parallel_order: Union[str, Sequence[str]] = "tp-cp-dp",
                 device_type: Optional[str] = None, timeout: Optional[datetime.timedelta] = None) -> ParallelGroups:
    """Create the tp/cp/dp (and tp x cp) groups of the default process group (collective: every
    rank calls it alike); without one, a single-process ``ParallelGroups``. ``world_size``, when
    given, must be the process group's size. ``timeout``: how long their collectives wait (torch
    gives a new group its own default, not the default group's)."""
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if world_size is not None and world_size != world:
        raise ValueError(f"world size {world_size} was requested but the process group has {world} "
                         f"rank(s){'' if initialized else ' (torch.distributed is not initialised)'}")
    tp, cp, dp, order = validate_parallel_config(world, tensor_parallel, context_parallel, parallel_order)
    if not initialized:
        return ParallelGroups(order=order)
    rank = dist.get_rank()
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    coords = rank_coords(rank, sizes, order)
    lists = group_ranks(world, tp, cp, order)
    mine = {name: next(g for g in lists[name] if rank in g) for name in lists}

    handles = {}
    if device_type is None:  # the default group's: "nccl" or "cpu:gloo,cuda:nccl" -> cuda
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    dims = tuple(reversed(order))  # mesh dims slowest -> fastest; the last dim is contiguous
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in dims),
                            mesh_dim_names=dims, **_mesh_timeout(dims, timeout))
    for name in AXES:
        handles[name] = mesh.get_group(name)
        got = dist.get_process_group_ranks(handles[name])
        if got != mine[name]:  # the mesh must agree with group_ranks, which tests and logs use
            raise RuntimeError(f"DeviceMesh {name} group {got} differs from expected {mine[name]}")
    if tp == 1 or cp == 1:  # the replica is the tp or the cp group
        handles["mp"] = handles["cp" if tp == 1 else "tp"]
    else:  # every rank creates every replica group, in the same order
        for ranks in lists["mp"]:
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                handles["mp"] = g
    return ParallelGroups(
        tensor_parallel=tp, context_parallel=cp, data_parallel=dp, order=order, rank=rank, world_size=world,
        tp_rank=coords["tp"], cp_rank=coords["cp"], dp_rank=coords["dp"],
        tp_ranks=mine["tp"], cp_ranks=mine["cp"], dp_ranks=mine["dp"], mp_ranks=mine["mp"],
        tp_group=handles["tp"], cp_group=handles["cp"], dp_group=handles["dp"], mp_group=handles["mp"],
        mesh=mesh,
    )
