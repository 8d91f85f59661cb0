"""Run-time set-up: the device, the process group, and who does what. Ranks come from the
environment torchrun or ``export_DDP_vars.sh`` (Slurm) sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; without them, one process); NCCL joins GPU ranks, gloo CPU ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import glob
import logging
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING
from unittest import mock

import torch
import torch.distributed as dist

from distributed.groups import ParallelGroups, build_groups, validate_parallel_config
from distributed.parallelize import validate_vit_layout
from engine import fp8_linears
from engine.optimizer import check_end
from settings.errors import ConfigError, UserError, on_every_rank

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config, ViTConfig

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None  # the data-parallel process group; None is torch's default (world) group
    groups: ParallelGroups | None = None  # the tp x cp x dp groups when tensor/context parallel
    host_group: object = None  # all ranks, for collectives on host tensors (gloo); None: default
    local_batch: int = 1
    global_batch: int = 1

    is_main = property(lambda self: self.rank == 0)
    distributed = property(lambda self: self.world_size > 1)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:  # over the data-parallel ranks, in place
        if self.distributed:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def raise_first_failure(self, failure, kind: type[UserError]):
        """Collective (host group): raise ``kind`` of the first of the ranks' ``failure`` (``(rank,
        line)`` or None) on every rank, not on one alone (the others would wait in their next
        collective); return when none failed."""
        if self.distributed:
            outcomes = [None] * self.world_size
            dist.all_gather_object(outcomes, failure, group=self.host_group)
            failure = next((f for f in outcomes if f is not None), None)
        if failure is not None:
            rank, line = failure
            raise on_every_rank(kind(f"rank {rank}: {line}" if self.distributed else line))

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def shutdown(self):
        if dist.is_initialized():
            dist.destroy_process_group()


# The oldest torch this project runs on; requirements.txt, docker/Dockerfile's base image and the
# README say the same (tests check that they agree).
TORCH_FLOOR = (2, 5)


def check_torch_version(version: str | None = None):
    """Refuse a torch below ``TORCH_FLOOR`` (NGC's "2.6.0a0+..." counts as 2.6)."""
    version = version or torch.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ConfigError(f"torch {version} is older than this project supports (torch >= "
                          f"{floor}): install a newer torch (pip install 'torch>={floor}'), or use "
                          f"the container of docker/README.md")


def gpu_signs() -> list[str]:
    """What says this node has GPUs for this process: Slurm's and CUDA's variables, device files."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    signs = [f"CUDA_VISIBLE_DEVICES={cvd}"] if cvd not in (None, "", "-1", "NoDevFiles") else []
    signs += [f"{var}={os.environ[var]}" for var in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
                                                     "SLURM_STEP_GPUS")
              if os.environ.get(var, "") not in ("", "0")]
    if devices := sorted(glob.glob("/dev/nvidia[0-9]*")):
        signs.append(devices[0] + (f" (and {len(devices) - 1} more)" if len(devices) > 1 else ""))
    return signs


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
                f"torch for the node's driver (pip install torch from the default index, or the "
                f"site's PyTorch module or the container of docker/README.md)")
    return (f"this torch (CUDA {torch.version.cuda}) finds no usable GPU (torch.cuda.is_available()"
            f" is false): check the driver (nvidia-smi) and that the job was given GPUs")


def choose_device(cfg: Config, local_rank: int) -> torch.device:
    """The device: cuda when present, else cpu; a node whose GPUs this torch cannot use is refused
    unless ``--device cpu`` (training on its CPU would waste the allocation)."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        signs = gpu_signs()
        if cfg.device == "cuda":
            raise ConfigError(f"device=cuda but no CUDA device is visible"
                              f"{' (' + ', '.join(signs) + ')' if signs else ''}: "
                              + (_no_cuda_reason() if signs else
                                 "use --device auto (cpu here) or run on a GPU node"))
        if signs:
            raise ConfigError(f"this node has GPUs ({', '.join(signs)}) but "
                              f"{_no_cuda_reason()}; or train on the CPU with --device cpu")
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {n} GPU(s): launch at most "
                          f"{n} ranks per node (one per GPU)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def configure_cuda(cfg: Config, device: torch.device):
    """cuDNN autotuning (the U-Net's 3D convolutions: 2.9x faster on an H100) or deterministic
    algorithms; TF32 unless ``allow_tf32`` is false or NVIDIA_TF32_OVERRIDE=0 (torch's switches,
    which the MFU reads, then say it is off)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        torch.backends.cudnn.deterministic = not cfg.cudnn_benchmark
        tf32 = cfg.allow_tf32 and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


# The compute dtype of each amp_mode (None: autocast off).
AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_amp(cfg: Config, device: torch.device):
    if cfg.amp_mode == "fp16" and device.type != "cuda":
        raise ConfigError("amp_mode=fp16 needs a CUDA GPU (its gradient scaler and fast fp16 "
                          "kernels are GPU features): use --amp_mode bf16 or none on a CPU")


def _env_int(name, default):
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an "
                          f"integer") from None


def batch_sizes(cfg: Config, dp_size: int) -> tuple[int, int]:
    """(local, global) batch sizes, global split evenly over dp ranks and grad_accum_steps."""
    if cfg.local_batch_size is not None:
        local, global_ = cfg.local_batch_size, cfg.local_batch_size * dp_size
    elif cfg.global_batch_size % dp_size:
        lo = cfg.global_batch_size // dp_size * dp_size
        options = ", ".join(str(v) for v in (lo, lo + dp_size) if v > 0)
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} does not divide by the "
                          f"{dp_size} data-parallel ranks: choose a multiple of {dp_size} "
                          f"(e.g. {options}) or set --local_batch_size")
    else:
        local, global_ = cfg.global_batch_size // dp_size, cfg.global_batch_size
    k = cfg.grad_accum_steps
    if local % k:
        raise ConfigError(f"grad_accum_steps={k} does not divide the {local} samples per rank and "
                          f"step (global batch {global_} over {dp_size} data-parallel rank(s)): "
                          f"choose a divisor of {local}, or a global batch of "
                          f"{dp_size * k * max(1, round(local / k))}")
    return local, global_


def check_model_parallel(cfg: ViTConfig, world: int):
    """tp x cp x dp == world size and a ViT that shards over them."""
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    if world == 1:  # (started with python, not torchrun)
        raise ConfigError(f"tensor_parallel={tp} x context_parallel={cp} splits each model over "
                          f"{tp * cp} ranks, and this is one process: start them with torchrun: "
                          f"torchrun --nproc_per_node {tp * cp} {shlex.join(sys.argv)}")
    if cfg.noddp:
        raise ConfigError("noddp turns off the data-parallel gradient all-reduce for timing; it "
                          "cannot be combined with tensor_parallel/context_parallel")
    try:
        validate_parallel_config(world, tp, cp, cfg.parallel_order)
        validate_vit_layout(cfg.img_size, cfg.patch_size, cfg.embed_dim, cfg.num_heads,
                            int(cfg.embed_dim * cfg.mlp_ratio),
                            ParallelGroups(tensor_parallel=tp, context_parallel=cp), cfg.sequence_parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def new_host_group(timeout: datetime.timedelta):
    """A gloo group of all ranks (collective), connected lazily (``TORCH_GLOO_LAZY_INIT``): 2
    connections a rank for its ring all-reduces, not a mesh of N - 1 at start-up."""
    with mock.patch.dict(os.environ, TORCH_GLOO_LAZY_INIT="1"):
        return dist.new_group(backend="gloo", timeout=timeout)


def setup_runtime(cfg: Config) -> Runtime:
    local_rank = _env_int("LOCAL_RANK", 0)
    device = choose_device(cfg, local_rank)
    configure_cuda(cfg, device)
    fp8_linears.check(getattr(cfg, "fp8_linears", "none"), device)  # torchao, the GPU's fp8
    tp = getattr(cfg, "tensor_parallel", 1)
    cp = getattr(cfg, "context_parallel", 1)
    sharded = tp * cp > 1
    # Checked before any process group exists, so every rank fails at once with the same
    # message, which rank 0 alone prints (``every_rank``).
    try:
        world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
        check_amp(cfg, device)
        if sharded:
            check_model_parallel(cfg, world)
        local_batch, global_batch = batch_sizes(cfg, world // (tp * cp))
        check_end(cfg.lr, cfg.end_lr, global_batch, cfg.base_batch_size, cfg.lr_scaling)
        for var in ("MASTER_ADDR", "MASTER_PORT") if world > 1 else ():
            if var not in os.environ and not dist.is_initialized():
                raise ConfigError(f"WORLD_SIZE={world} but {var} is not set: launch with torchrun "
                                  f"or source export_DDP_vars.sh in the job script")
    except ConfigError as e:
        raise on_every_rank(e)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    rt = Runtime(device=device, rank=rank, world_size=world, local_rank=local_rank,
                 dp_rank=rank, dp_size=world, local_batch=local_batch, global_batch=global_batch)
    if sharded:
        rt.groups = build_groups(world, tp, cp, cfg.parallel_order, timeout=timeout)
        rt.dp_group, rt.dp_rank, rt.dp_size = rt.groups.dp_group, rt.groups.dp_rank, rt.groups.dp_size
    if world > 1 and dist.get_backend() != "gloo":
        # (the ranks' stop agreement runs on the host: on NCCL reading it would sync the device)
        rt.host_group = new_host_group(timeout)
    return rt


# Words that mark a RuntimeError as raised by a process-group backend (gloo raises plain
# RuntimeErrors naming its source path; NCCL raises torch.distributed.DistBackendError).
_BACKEND_MARKERS = ("gloo", "nccl", "processgroup", "connection reset by peer",
                    "connection closed by peer")


def describe_dist_failure(exc: BaseException, cfg: Config, where: str) -> str | None:
    """One line for a failed collective or rendezvous, else None; ``where``: "after step 12"."""
    text = str(exc)
    low = text.lower()
    if not isinstance(exc, dist.DistError) and not (
            isinstance(exc, RuntimeError) and any(m in low for m in _BACKEND_MARKERS)):
        return None
    # The backend's own words, without its source location, on one line.
    detail = re.sub(r"\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", text).strip().splitlines()
    detail = (detail[0] if detail else type(exc).__name__).split(". ")[0][:200].rstrip(". ")
    timeout = f"dist_timeout_s={cfg.dist_timeout_s}"
    if not dist.is_initialized() and isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"could not join the process group at {addr} ({detail}): check that all "
                f"WORLD_SIZE={os.environ.get('WORLD_SIZE', '?')} ranks were started, that "
                f"MASTER_ADDR/MASTER_PORT name rank 0's host and a free port; ranks wait "
                f"{timeout} s for each other")
    if "timed out" in low or "timeout" in low:
        return (f"a collective timed out {where} ({detail}): another rank stopped responding for "
                f"{timeout} s (hung or died; its own output shows why), or is legitimately "
                f"slower (compiling, writing a checkpoint): then raise --dist_timeout_s")
    return (f"a collective failed {where} ({detail}): another rank most likely died (crash, out "
            f"of memory, killed, node failure); the first error in the other ranks' output is "
            f"the cause. A rank that hangs instead makes the others fail after {timeout} s")


# torch.OutOfMemoryError is newer than the floor; torch.cuda's is the same class where both exist.
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def describe_allocation_failure(exc: BaseException, cfg: Config, rt: Runtime | None,
                                where: str) -> str | None:
    """One line for a failed allocation naming the settings that decide the sizes, else None."""
    low = str(exc).lower()
    if not (isinstance(exc, (MemoryError, OUT_OF_MEMORY))
            or "can't allocate memory" in low or "out of memory" in low):
        return None
    tried = re.search(r"tried to allocate ([0-9.]+ ?[a-z]*)", str(exc), re.IGNORECASE)
    size = f" ({tried.group(0)})" if tried else ""
    device = rt.device if rt is not None else cfg.device
    settings = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                         if f.metadata.get("size"))
    batch = rt.local_batch if rt is not None else cfg.local_batch_size or cfg.global_batch_size
    return (f"out of memory on {device} {where}{size}: the model or a step does not fit with "
            f"{settings}, {batch} samples per rank: lower these, or split the step with "
            f"--grad_accum_steps")
