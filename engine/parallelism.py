"""Parallelism applied to a serial model, in one place and in this order:

1. sharding over the tensor/context-parallel ranks (``distributed.parallelize``), when
   tensor_parallel x context_parallel > 1: each rank keeps its slices of the serial weights, so
   a sharded run starts where a serial run with the same seed starts;
2. activation checkpointing, an option of the model itself (chosen when the task builds it;
   the sharded ViT keeps the serial model's choice);
3. the move to the run's device, in the task's memory format (channels-last weights for the
   U-Net on a GPU: ``memory_format``);
4. DistributedDataParallel over the data-parallel ranks (with model parallelism, its
   communication hook also sums the gradients of parameters replicated over tp/cp);
5. ``torch.compile`` (the ``enable_jit`` setting) of the whole wrapped model. Under tp/cp the
   sharded layers' collectives stay out of the compiled graphs: each is a graph break and runs
   eagerly (``distributed.mappings.eager_apply``), the compute between them is compiled.

The model itself knows nothing of any of this.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from distributed.grad_norm import clip_grad_norm
from distributed.parallelize import parallelize_vit
from engine.runtime import Runtime
from engine.sharding import RowBandSharding, Unsharded

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

    def no_sync(self):
        """Inside: backward passes accumulate gradients without DDP's all-reduce (the inner
        micro-batches of gradient accumulation); a do-nothing context without DDP."""
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile
        return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Norm of the serial model's gradient (before clipping), clipped to ``max_norm`` when > 0."""
        return clip_grad_norm(self.module, max_norm, self.rt.groups)


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
    model = model.to(rt.device)  # 3.
    if memory_format != torch.contiguous_format:  # the U-Net's channels-last 5-D weights
        model = model.to(memory_format=memory_format)
    wrapped = model
    if rt.distributed and cfg.noddp:
        log.warning("noddp is set: gradients are NOT all-reduced; the model replicas are not "
                    "synchronised (for compute-only scaling measurements)")
    elif rt.distributed and (rt.dp_size > 1 or rt.groups is not None):  # 4. data parallel
        wrapped = DistributedDataParallel(
            model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
            process_group=rt.dp_group, bucket_cap_mb=cfg.bucket_cap_mb,
            **_buffer_sync_kwargs(cfg.disable_broadcast_buffers))
        sharding.register_grad_hooks(wrapped)
    if cfg.enable_jit:  # 5. torch.compile
        # The tp/cp autograd Functions call c10d collectives; they are torch.compiler.disable'd
        # where they are applied (distributed.mappings.eager_apply, as the DL4SCI25 reference
        # disables its mapping helpers), so dynamo breaks the graph at each collective instead
        # of tracing it into functional collectives: the compiled graphs hold per-rank compute
        # only, and the collectives run as in an eager step (tests/test_mp_compile.py).
        wrapped = torch.compile(wrapped, options=task.compile_options(memory_format) or None)
    return ParallelModel(model, wrapped, sharding, rt)
