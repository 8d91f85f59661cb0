"""Parallelism applied to a serial model, in one place and in this order:

1. sharding over the tensor/context-parallel ranks (``distributed.parallelize``), when
   tensor_parallel x context_parallel > 1: each rank keeps its slices of the serial weights, so
   a sharded run starts where a serial run with the same seed starts;
2. fp8 linears (``fp8_linears``: ``engine.fp8_linears``), before FSDP shards them and
   torch.compile traces them;
3. activation checkpointing, an option of the model itself (the sharded ViT keeps the serial
   model's choice);
4. the move to the run's device, in the task's memory format (``memory_format``), the
   torch/cuDNN combinations known to be slow for this model there named in the log
   (``engine.slow_paths``);
5. data parallelism: DistributedDataParallel (under tp/cp its communication hook also sums the
   gradients of parameters replicated over tp/cp), or with ``fsdp`` torch's FSDP2
   (``fully_shard``) of each of the task's blocks and then the whole model over the
   data-parallel mesh (under tp/cp the ``dp`` dimension of the tp x cp x dp mesh);
6. ``torch.compile`` (``enable_jit``) of the whole wrapped model, or with ``compile_blocks`` of
   each of the task's blocks in place (the parameters' names stay, so checkpoints are the same
   either way; blocks alike share one compiled graph). Under tp/cp the sharded layers'
   collectives run eagerly, a graph break each (``distributed.mappings.eager_apply``), with
   the compile caches where ``compile_cache_dir`` says (``compile_dir``: where they are).

docs/parallelism.md tells more. The model itself knows nothing of any of this.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from distributed.grad_norm import clip_grad_norm
from distributed.parallelize import parallelize_vit
from engine import fp8_linears
from engine.runtime import Runtime
from engine.slow_paths import warn_slow_paths
from engine.sharding import (FSDPModule, FullyShardedSharding, MixedPrecisionPolicy,
                             RowBandSharding, Unsharded, fully_shard)
from observe.profiling import use_compile_cache_dir
from settings.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """A model ready to train on this rank.

    ``module``: the model's parameters and state (sharded under tp/cp), for the optimizer,
    checkpoints and train/eval; ``wrapped``: what a step calls (``module`` under DDP and/or
    ``torch.compile``); ``sharding``: how batches enter and leave it and how its state maps to the
    serial layout (``engine.sharding``)."""

    module: nn.Module
    wrapped: nn.Module
    sharding: Unsharded
    rt: Runtime
    fsdp_reduce_each_microbatch: bool = True
    compile_dir: str | None = None  # where torch.compile's caches are (None: not compiled)
    batch: int = 0  # under torch.compile, the local batch every forward is given (full_batch)

    def no_sync(self):
        """Inside: the backward passes of the inner micro-batches of gradient accumulation.

        DDP: they accumulate gradients without its all-reduce, which then runs once, in the last
        micro-batch's backward. FSDP: by default a do-nothing context, as torchtitan does: every
        micro-batch's backward reduce-scatters its gradients onto the shards; with
        ``fsdp_reduce_each_microbatch`` off, FSDP2 keeps every parameter's whole unsharded
        gradient until the last micro-batch (docs/parallelism.md weighs the two)."""
        if isinstance(self.module, FSDPModule):
            if self.fsdp_reduce_each_microbatch:
                return contextlib.nullcontext()
            return _fsdp_no_sync(self.module)
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The DistributedDataParallel wrapper (under torch.compile's), or None without one."""
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)
        return ddp if isinstance(ddp, DistributedDataParallel) else None

    def reduce_replicated_grads(self):
        """After the backward passes, under FSDP with tp/cp: the gradient sums over tp/cp that
        DDP's communication hook does otherwise (nothing to do in any other run)."""
        self.sharding.reduce_replicated_grads(self.module)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Norm of the serial model's gradient (before clipping), clipped to ``max_norm`` when > 0."""
        return clip_grad_norm(self.module, max_norm, self.rt.groups)

    def full_batch(self, x: torch.Tensor) -> torch.Tensor:
        """A compiled model's validation batch filled up to the local batch with copies of its
        first sample, whose outputs are then dropped: the smaller last batch of a pass runs the
        graph compiled for the others instead of compiling one for a batch of any size (dynamo's
        response to a second batch size). Eager models take the batch as it is."""
        if not self.batch or x.shape[0] == self.batch:
            return x
        fill = torch.zeros(self.batch - x.shape[0], dtype=torch.long, device=x.device)
        return x[torch.cat([torch.arange(x.shape[0], device=x.device), fill])]  # keeps its layout

    def regroup_gradients(self, x: torch.Tensor, y: torch.Tensor, forward_context):
        """A resumed run's backward pass of its first micro-batch (``x``, ``y``) before its first
        step, discarded, under DDP.

        DDP all-reduces the gradients in buckets. It groups them anew after a run's first
        backward, in the order that backward made them ready, and every later step uses that
        grouping, in which the ranks' ring adds each element in a fixed order. A resumed run's
        first step would use the first grouping, so with three or more ranks it would add some
        elements in another order (about 1e-7 apart). This backward makes DDP regroup as the
        uninterrupted run did. Its gradients are dropped, and the random streams and buffers are
        put back, so the resumed run continues bitwise as the uninterrupted one (checked on the
        CPU: tests/test_preemption.py). One micro-batch's forward and backward more at each
        resume."""
        buffers = [(b, b.clone()) for b in self.module.buffers()]
        device = self.rt.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with forward_context():
                loss = self.sharding.loss(self.wrapped(x), y).sum()
            loss.backward()
        self.module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)


@contextlib.contextmanager
def _fsdp_no_sync(module):
    """FSDP2 keeps the unsharded gradients of the micro-batches inside and reduce-scatters their
    sum (over dp: every rank leaves after the same micro-batch) in the next backward."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def mixed_precision_policy(amp_mode: str) -> MixedPrecisionPolicy:
    """FSDP2's casts matching ``amp_mode``: the gathered parameters in bf16 for the forward and
    backward (the engine's autocast still picks each op's precision), the gradients
    reduce-scattered in fp32 and the sharded parameters and Adam state kept in fp32. fp16 is
    refused with fsdp (``settings.config.validate``)."""
    if amp_mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_fully(model: nn.Module, blocks: list[nn.Module], amp_mode: str, rt: Runtime,
                mesh=None) -> nn.Module:
    """``fully_shard`` each block, then the whole model (what is left: embeddings, head, norms)
    over a one-dimensional data-parallel mesh: ``mesh`` (the dp dimension of the tp x cp x dp
    mesh), or one over every rank. A block's weights are gathered together, so peak memory holds
    the largest gathered block on top of the shards."""
    if mesh is None:
        mesh = init_device_mesh(rt.device.type, (rt.dp_size,), mesh_dim_names=("dp",))
    policy = mixed_precision_policy(amp_mode)
    # The tp/cp layers' marks on their parameters (how each is cut from the serial one, over
    # which axes its copies' gradients are summed), for the DTensor parameters FSDP puts in place.
    marks = {name: {k: getattr(p, k) for k in ("shard_spec", "reduce_over") if hasattr(p, k)}
             for name, p in model.named_parameters()}
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name, p in model.named_parameters():
        for k, v in marks[name].items():
            setattr(p, k, v)
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    log.info(f"FSDP: {len(blocks)} blocks and the rest of the model sharded over {rt.dp_size} "
             f"data-parallel ranks; the largest block gathers {largest / 1e6:.3g} M parameters"
             + (f" in {amp_mode}" if amp_mode == "bf16" else ""))
    return model


def _buffer_sync_kwargs(disable: bool) -> dict:
    """DDP's per-step broadcast of module buffers from rank 0: on unless disabled. Newer torch
    calls the switch forward_sync_buffers (and warns on every rank when broadcast_buffers is
    passed at all); buffers are still made equal once, at wrapping."""
    if not disable:
        return {}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def apply_parallelism(model: nn.Module, cfg: Config, rt: Runtime, task,
                      memory_format: torch.memory_format = torch.contiguous_format
                      ) -> ParallelModel:
    """``model``: the serial model, built on the CPU with the same seed on every rank (a sharded
    model never lives whole on a GPU); ``memory_format``: the layout of its 5-D weights there."""
    if rt.groups is not None:  # 1. tensor / context parallel
        model = parallelize_vit(model, rt.groups, sequence_parallel=cfg.sequence_parallel)
        sharding = RowBandSharding(task, model, rt.groups)
    else:
        sharding = Unsharded(task)
    fp8 = getattr(cfg, "fp8_linears", "none")
    if fp8 != "none":  # 2. fp8 linears (checked with the device: engine.runtime)
        fp8_linears.convert(task.blocks(model), fp8, rt.device)
    warn_slow_paths(model, rt.device, cfg.amp_mode, memory_format, rt.is_main)  # 4.
    model = model.to(rt.device)
    if memory_format != torch.contiguous_format:  # the U-Net's channels-last 5-D weights
        model = model.to(memory_format=memory_format)
    wrapped = model
    if cfg.fsdp and rt.dp_size == 1:
        log.info("fsdp with one data-parallel rank: nothing to shard over, the replica trains as "
                 "without fsdp")
    if cfg.fsdp and rt.dp_size > 1:  # 5. sharded data parallel
        # (noddp and fp16 with fsdp are refused with the settings)
        mesh = rt.groups.mesh["dp"] if rt.groups is not None else None
        model = shard_fully(model, task.blocks(model), cfg.amp_mode, rt, mesh)
        sharding = FullyShardedSharding(task, sharding)
    elif rt.distributed and cfg.noddp:
        log.warning("noddp is set: gradients are NOT all-reduced; the model replicas are not "
                    "synchronised (for compute-only scaling measurements)")
    elif rt.distributed and (rt.dp_size > 1 or rt.groups is not None):  # 5. data parallel
        wrapped = DistributedDataParallel(
            model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
            process_group=rt.dp_group, bucket_cap_mb=cfg.bucket_cap_mb,
            **_buffer_sync_kwargs(cfg.disable_broadcast_buffers))
        sharding.register_grad_hooks(wrapped)
    compile_dir = None
    if cfg.enable_jit:  # 6. torch.compile (tp/cp collectives stay out of the graphs: eager_apply)
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
    return ParallelModel(model, wrapped, sharding, rt, cfg.fsdp_reduce_each_microbatch,
                         compile_dir, rt.local_batch if cfg.enable_jit else 0)
