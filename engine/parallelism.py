"""Parallelism applied to a serial model, in one place: ``apply_parallelism``, whose numbered
comments give the order (docs/parallelism.md). The model itself knows nothing of any of this."""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from distributed.grad_norm import clip_grad_norm
from distributed.parallelize import parallelize_vit
from engine import fp8_linears
from engine.runtime import AMP_DTYPES, Runtime
from engine.slow_paths import warn_slow_paths
from engine.sharding import (FSDPModule, FullyShardedSharding, MixedPrecisionPolicy,
                             RowBandSharding, Unsharded, fully_shard)
from observe.memory import memory_warning
from observe.profiling import use_compile_cache_dir
from settings.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """A model ready to train: ``module`` its parameters, ``wrapped`` what a step calls (under DDP
    and/or ``torch.compile``), ``loss(pred, y)`` the task's per-sample loss of its output (of
    image bands: summed over the ranks of the other bands), ``sharding`` how batches and state
    map to it."""

    module: nn.Module
    wrapped: nn.Module
    loss: object
    sharding: Unsharded
    rt: Runtime
    fsdp_reduce_each_microbatch: bool = True
    compile_dir: str | None = None  # where torch.compile's caches are (None: not compiled)
    batch: int = 0  # under torch.compile, the local batch every forward is given (full_batch)

    def no_sync(self):
        """Inside: the inner micro-batches' backward passes. DDP all-reduces in the last; FSDP in
        each, or with ``fsdp_reduce_each_microbatch`` off in the last (docs/parallelism.md)."""
        if isinstance(self.module, FSDPModule) and not self.fsdp_reduce_each_microbatch:
            return _fsdp_no_sync(self.module)
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The DistributedDataParallel wrapper (under torch.compile's), or None without one."""
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)
        return ddp if isinstance(ddp, DistributedDataParallel) else None

    def reduce_replicated_grads(self):  # (FSDP with tp/cp: FullyShardedSharding's)
        self.sharding.reduce_replicated_grads(self.module)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Norm of the serial model's gradient (before clipping), clipped to ``max_norm`` when > 0:
        torch's own for a whole model (inf scales by exactly 1), else ``distributed.grad_norm``."""
        if self.rt.groups is None and not isinstance(self.module, FSDPModule):
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm or float("inf"))
        return clip_grad_norm(self.module, max_norm, self.rt.groups)

    def full_batch(self, x: torch.Tensor) -> torch.Tensor:
        """A compiled model's validation batch filled up to the local batch with copies of its
        first sample (docs/performance.md, "Fused Adam"); eager: the batch as it is."""
        if not self.batch or x.shape[0] == self.batch:
            return x
        fill = torch.zeros(self.batch - x.shape[0], dtype=torch.long, device=x.device)
        return x[torch.cat([torch.arange(x.shape[0], device=x.device), fill])]  # keeps its layout

    def regroup_gradients(self, x: torch.Tensor, y: torch.Tensor, forward_context):
        """A resumed run's backward of its first micro-batch (``x``, ``y``), discarded (gradients
        dropped, random streams and buffers put back), to group DDP's gradient buckets as the
        uninterrupted run did (docs/checkpoints.md)."""
        buffers = [(b, b.clone()) for b in self.module.buffers()]
        device = self.rt.device
        y = y if y.dim() == x.dim() else y[:, 0]  # a rollout's first targets: one step suffices
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with forward_context():
                loss = self.loss(self.wrapped(x), y).sum()
            loss.backward()
        self.module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)


@contextlib.contextmanager
def _fsdp_no_sync(module):  # the sum is reduce-scattered in the backward after it
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def mixed_precision_policy(amp_mode: str) -> MixedPrecisionPolicy:
    """FSDP2's casts for ``amp_mode`` bf16: parameters gathered in bf16, gradients reduced and
    shards and Adam state kept in fp32 (fp16 is refused with fsdp)."""
    if amp_mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_parallelism(model: nn.Module, cfg: Config, rt: Runtime, task,
                      memory_format: torch.memory_format = torch.contiguous_format
                      ) -> ParallelModel:
    """``model``: the serial model, built on the CPU with the same seed on every rank (so a
    sharded run starts where a serial one does); ``memory_format``: its 5-D weights' layout."""
    if rt.groups is not None:  # 1. tensor / context parallel
        model = parallelize_vit(model, rt.groups, sequence_parallel=cfg.sequence_parallel)
        sharding = RowBandSharding(task, model, rt.groups)
    else:
        sharding = Unsharded(task)
    fp8 = getattr(cfg, "fp8_linears", "none")
    if fp8 != "none":  # 2. fp8 linears, before FSDP shards and torch.compile traces them
        fp8_linears.convert(task.blocks(model), fp8, rt.device)
    # (3. activation checkpointing is the model's own option.) 4. the device, where the known
    # slow torch/cuDNN combinations for this model and a step too big for its memory (estimated
    # on fake tensors before anything is allocated there; whole models only) are named
    warn_slow_paths(model, rt.device, cfg.amp_mode, memory_format, rt.is_main)
    shape = task.sample_shape() if rt.is_main and rt.groups is None and not cfg.fsdp else None
    if shape and (warning := memory_warning(model, shape, rt.local_batch, rt.device,
                                            AMP_DTYPES[cfg.amp_mode],
                                            int(os.environ.get("LOCAL_WORLD_SIZE", 1)))):
        log.warning(f"Memory: {warning}")
    model = model.to(rt.device)
    if memory_format != torch.contiguous_format:  # the U-Net's channels-last 5-D weights
        model = model.to(memory_format=memory_format)
    wrapped = model
    if cfg.fsdp and rt.dp_size == 1:
        log.info("fsdp with one data-parallel rank: nothing to shard over, the replica trains as "
                 "without fsdp")
    if cfg.fsdp and rt.dp_size > 1:  # 5. sharded data parallel
        # (noddp and fp16 with fsdp are refused with the settings): each block, then the rest,
        # over the dp dimension of the tp x cp x dp mesh or one over every rank
        mesh = rt.groups.mesh["dp"] if rt.groups is not None else \
            init_device_mesh(rt.device.type, (rt.dp_size,), mesh_dim_names=("dp",))
        policy = mixed_precision_policy(cfg.amp_mode)
        blocks = task.blocks(model)
        # the tp/cp layers' marks on their parameters, for the DTensor parameters FSDP puts in place
        marks = {name: {k: getattr(p, k) for k in ("shard_spec", "reduce_over") if hasattr(p, k)}
                 for name, p in model.named_parameters()}
        for block in blocks + [model]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        for name, p in model.named_parameters():
            for k, v in marks[name].items():
                setattr(p, k, v)
        largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
        log.info(f"FSDP: {len(blocks)} blocks and the rest of the model sharded over {rt.dp_size} "
                 f"data-parallel ranks; the largest block gathers {largest / 1e6:.3g} M parameters"
                 + (f" in {cfg.amp_mode}" if cfg.amp_mode == "bf16" else ""))
        sharding = FullyShardedSharding(task, sharding)
    elif rt.distributed and cfg.noddp:
        log.warning("noddp is set: gradients are NOT all-reduced; the model replicas are not "
                    "synchronised (for compute-only scaling measurements)")
    elif rt.distributed and (rt.dp_size > 1 or rt.groups is not None):  # 5. data parallel
        # buffers' per-step broadcast off: newer torch names it forward_sync_buffers (and warns
        # on every rank when broadcast_buffers is passed)
        sync = "forward_sync_buffers" if "forward_sync_buffers" in \
            inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers"
        wrapped = DistributedDataParallel(
            model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
            process_group=rt.dp_group, bucket_cap_mb=cfg.bucket_cap_mb,
            **({sync: False} if cfg.disable_broadcast_buffers else {}))
        sharding.register_grad_hooks(wrapped)
    compile_dir = None
    # 6. torch.compile: tp/cp collectives stay out of the graphs (eager_apply); compile_blocks
    # compiles each block in place (the same parameter names, so the same checkpoints)
    if cfg.enable_jit:
        compile_dir = use_compile_cache_dir(cfg.compile_cache_dir)  # with earlier runs' caches
        options = task.compile_options(memory_format) or None
        if cfg.compile_blocks:
            blocks = task.blocks(model)
            if not blocks:
                raise ConfigError(f"compile_blocks=true: {type(task).__name__}'s model names no "
                                  f"blocks to compile one by one: drop --compile_blocks")
            for block in blocks:
                block.compile(options=options)
        else:
            wrapped = torch.compile(wrapped, options=options)
    loss = task.loss if rt.groups is None else sharding.loss
    return ParallelModel(model, wrapped, loss, sharding, rt, cfg.fsdp_reduce_each_microbatch,
                         compile_dir, rt.local_batch if cfg.enable_jit else 0)
