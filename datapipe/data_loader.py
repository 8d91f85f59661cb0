"""A run's data: synthetic data made when the config asks for it and none is there
(``ensure_data``), then the loaders for every problem: sharded sampling, workers, pinned memory.

The sampler decides everything about order: in epoch e the training samples are a permutation
drawn from (seed, e); step s takes the global batch ``perm[s*G:(s+1)*G]`` and data-parallel rank r
its slice ``[r*b:(r+1)*b]`` of it (G = global, b = local batch). So a data-parallel step sees
exactly the samples of the serial step with the same global batch, and a resumed run starts at the
step it stopped at. The sampler yields (epoch, index) keys (random crops draw anew each epoch);
what the samples are is the problem's data set's (``datapipe.data_sets``), assembled in the reused
buffers of ``datapipe.batch_pool.BatchLoader``.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from datapipe.batch_pool import BatchLoader, HostMemory, PinnedHostMemory
from datapipe import synthetic
from datapipe.data_sets import data_set
from datapipe.make_data import (SYNTHESIS_WAIT, check_synthesis_target, has_data,
                                 make_data_once)
from settings.errors import ConfigError, UserError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)


class ShardedSampler(Sampler):
    """Training order for one data-parallel rank (see the module docstring)."""

    def __init__(self, n, global_batch, local_batch, dp_rank, shuffle=True, seed=0):
        self.n, self.G, self.b, self.r = n, global_batch, local_batch, dp_rank
        self.shuffle, self.seed = shuffle, seed
        self.steps = n // global_batch
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0):
        self.epoch, self.start_step = epoch, start_step

    def order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def __iter__(self):
        perm = self.order()
        for s in range(self.start_step, self.steps):
            lo = s * self.G + self.r * self.b
            for i in perm[lo:lo + self.b]:
                yield (self.epoch, int(i))

    def __len__(self):
        return (self.steps - self.start_step) * self.b


class ValidationSampler(Sampler):
    """Contiguous, disjoint, complete shards of the validation set, one per data-parallel rank,
    their sizes differing by at most one (a shorter one's batches: ``validation_batch_sizes``)."""

    def __init__(self, n, dp_size, dp_rank):
        self.indices = range(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size)

    def __iter__(self):
        return ((0, i) for i in self.indices)

    def __len__(self):
        return len(self.indices)


def validation_batch_sizes(n: int, dp_size: int, dp_rank: int, batch: int) -> list[int]:
    """The sizes of data-parallel rank ``dp_rank``'s validation batches of at most ``batch``
    samples (its ``ValidationSampler`` shard of ``n``), then zeros up to the batch count of the
    largest shard: as many entries on every rank."""
    shard = len(ValidationSampler(n, dp_size, dp_rank))
    sizes = [min(batch, shard - i) for i in range(0, shard, batch)]
    largest = -(-n // dp_size)  # the shards differ by at most one sample
    return sizes + [0] * (-(-largest // batch) - len(sizes))


class CachedBatchLoader:
    """One batch kept on ``device`` in ``memory_format`` and served for every batch of a pass of
    ``sampler`` (the last one cut to the samples left): compute-only timing, nothing read."""

    never_waits = True  # makes each batch in this process, at once: no data wait (engine)

    def __init__(self, batch, sampler, batch_size: int, device,
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.batch = tuple(torch.as_tensor(a).to(device).contiguous(memory_format=memory_format)
                           for a in batch)
        self.sampler, self.batch_size = sampler, batch_size

    def _sizes(self) -> list[int]:
        n, b = len(self.sampler), self.batch_size  # samples of this pass (after a resume: left)
        return [min(b, n - i) for i in range(0, n, b)]

    def __iter__(self):
        x, y = self.batch
        for n in self._sizes():
            yield x[:n], y[:n]

    def __len__(self):
        return len(self._sizes())


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters (malloc.h)


@functools.lru_cache(maxsize=None)
def reuse_freed_memory() -> bool:
    """Let this process reuse the memory of freed batches instead of mapping fresh pages: glibc
    maps each large allocation afresh and unmaps it when freed, a page fault per 4 kB page of
    every batch (half the loader's time on a 360 x 720 ERA5 batch). Raised mmap and trim
    thresholds keep freed blocks in the heap (grown in 512 MB steps). Once per process; False
    without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 1 << 34)
                and mallopt(_M_TOP_PAD, 1 << 29))


@dataclass
class Loaders:
    train: object
    valid: object
    train_sampler: ShardedSampler
    steps_per_epoch: int
    n_train: int
    n_valid: int
    _begun: tuple | None = field(default=None, repr=False)  # (epoch, first, loader, pass)

    def begin_training_pass(self, epoch: int, first: int = 0):
        """Begin the training pass of ``epoch`` from its batch ``first`` now, for
        ``begun_training_pass``: a loader's workers read its first batches while the caller goes
        on (the trainer builds its model); a loader without workers reads in ``next``."""
        self.train_sampler.set_epoch(epoch, first)
        self._begun = (epoch, first, self.train, iter(self.train))

    def begun_training_pass(self, epoch: int, first: int):
        """The pass ``begin_training_pass`` began, once, if it is of ``epoch`` from its batch
        ``first`` and ``train`` is still the loader it began on; else None."""
        begun, self._begun = self._begun, None
        if begun is None or begun[:3] != (epoch, first, self.train):
            return None
        return begun[3]

    def close(self):
        """End the loader worker processes now (``BatchLoader.close``) rather than whenever
        garbage collection gets to the loaders; loaders without workers may have no ``close``."""
        for loader in (self.train, self.valid):
            close = getattr(loader, "close", None)
            if callable(close):
                close()


def _loader(dataset, sampler, batch_size, cfg: Config, device, seed):
    """The loader of one data set: batches in a pool of shared buffers, filled by
    ``cfg.num_data_workers`` processes (0: this one), pinned on a GPU; worker seeds come from
    ``seed`` (not the global RNG, so starting a pass does not shift the model's random stream)."""
    reuse_freed_memory()  # other large allocations of this process reuse freed memory
    memory = PinnedHostMemory(device) if device.type == "cuda" else HostMemory()
    return BatchLoader(dataset, sampler, batch_size, workers=cfg.num_data_workers,
                       prefetch_depth=cfg.prefetch_depth, memory=memory, seed=seed)


def _samplers(cfg: Config, shuffle: bool, n_train: int, n_valid: int, dp_size: int, dp_rank: int,
              local_batch: int) -> tuple[ShardedSampler, ValidationSampler]:
    """The training and validation samplers of one data-parallel rank, once the counts suffice."""
    global_batch = local_batch * dp_size
    if n_train < global_batch:
        raise ConfigError(f"global_batch_size={global_batch} exceeds the {n_train} training "
                          f"samples: lower the batch size or use more data "
                          f"(limit_nsamples/Nsamples)")
    if n_valid < dp_size:
        raise ConfigError(f"the {n_valid} validation samples cannot be shared by {dp_size} "
                          f"data-parallel ranks (each needs at least one): use more validation "
                          f"samples (limit_nsamples_val/Nsamples_val) or fewer ranks")
    return (ShardedSampler(n_train, global_batch, local_batch, dp_rank, shuffle=shuffle,
                           seed=cfg.seed), ValidationSampler(n_valid, dp_size, dp_rank))


def ensure_data(cfg: Config, rank: int, world_size: int):
    """Synthesise small data under data_root when the config asks for it and none is there
    (``make_data_once``); a run on synthetic data made earlier says what made it. Collective when
    ``world_size`` > 1: rank 0 decides and writes, every rank returns or raises alike."""
    if cfg.data_is_generated:
        return
    if has_data(cfg) and (maker := synthetic.made_by(cfg.data_root)) is not None:
        log.info(f"Data: the synthetic {cfg.model} data under {cfg.data_root} (made by {maker}: "
                 f"not real data)")
        return
    if not cfg.synthesize_if_missing:
        return
    # Every rank checks that synthesis would not write over a user's files (so all stop alike);
    # rank 0 alone writes, and decides for everyone whether it does.
    distributed = world_size > 1
    missing = not has_data(cfg)
    if missing:
        check_synthesis_target(cfg)
    if distributed:
        decision = [missing]
        dist.broadcast_object_list(decision, src=0)  # rank 0's view: it writes when it sees none
        missing = decision[0]
    if not missing:
        return
    # The other ranks wait until the whole set is written (none may read a training file whose
    # validation file is still to come), in a gloo group of their own: full-size synthesis (or
    # the wait for another run making it) can outlast the default group's dist_timeout_s, and
    # NCCL's watchdog would end the run.
    waiting = dist.new_group(backend="gloo", timeout=SYNTHESIS_WAIT) if distributed else None
    outcome = [None]
    if rank == 0:
        others = f"; the other {world_size - 1} rank(s) wait for it" if distributed else ""
        try:
            make_data_once(cfg, others)
        except UserError as e:
            outcome = [e]  # every rank raises it
    if waiting is not None:
        dist.broadcast_object_list(outcome, src=0, group=waiting)
        dist.destroy_process_group(waiting)
    if outcome[0] is not None:
        raise outcome[0]


def build_loaders(cfg: Config, dp_size: int, dp_rank: int, local_batch: int, device,
                  rows: tuple[int, int] | None = None,
                  memory_format: torch.memory_format = torch.contiguous_format) -> Loaders:
    """Loaders of one data-parallel rank. ``rows=(start, stop)``: the training batches hold only
    those image rows, read as such (a model-parallel ViT rank's band, ``ParallelViT.image_rows()``;
    validation batches stay whole). ``memory_format``: the batches' layout on the device, in which
    the device loader cuts and the generated training batch is kept (the other loaders' batches
    keep the host layout: ``Trainer.to_device`` converts them)."""
    data = data_set(cfg)
    if rows is not None and not data.row_bands:
        raise ValueError(f"rows={rows!r} selects image rows of samples; the {cfg.model} "
                         f"loader reads whole samples: pass rows=None")
    if cfg.data_loader_config.startswith("dali") or cfg.data_loader_config == "device":
        # Built on this function's loaders for a host config; DALI, optional, imported only here.
        def reference(host_cfg):
            return build_loaders(host_cfg, dp_size, dp_rank, local_batch, device, rows)

        if cfg.data_loader_config == "device":
            from datapipe.device_loader import build_device_loaders
            return build_device_loaders(cfg, reference, local_batch, device, memory_format)
        from datapipe.dali_loader import build_dali_loaders
        return build_dali_loaders(cfg, reference, local_batch, device)
    if cfg.data_is_generated:
        return generated_loaders(cfg, dp_size, dp_rank, local_batch, device, rows, memory_format)
    train, valid = data.datasets(rows)
    sampler, valid_sampler = _samplers(cfg, data.shuffle, len(train), len(valid), dp_size, dp_rank,
                                       local_batch)
    seed = cfg.seed * 1000 + dp_rank
    train_loader = _loader(train, sampler, local_batch, cfg, device, seed)
    valid_loader = _loader(valid, valid_sampler, local_batch, cfg, device, seed + 500)
    return Loaders(train_loader, valid_loader, sampler, sampler.steps, len(train), len(valid))


def generated_loaders(cfg: Config, dp_size: int, dp_rank: int, local_batch: int, device,
                      rows: tuple[int, int] | None = None,
                      memory_format: torch.memory_format = torch.contiguous_format) -> Loaders:
    """``--data_loader_config synthetic`` (docs/performance.md): the rank's first training and
    validation batches, made in memory (``datapipe.generated_data``); the samplers are the real ones."""
    data = data_set(cfg)
    n_train, n_valid = data.generated_counts()
    sampler, valid_sampler = _samplers(cfg, data.shuffle, n_train, n_valid, dp_size, dp_rank,
                                       local_batch)
    t0 = time.perf_counter()
    train_batch = data.generated_batch(list(itertools.islice(sampler, local_batch)), "train",
                                       rows)
    valid_batch = data.generated_batch(list(itertools.islice(valid_sampler, local_batch)),
                                       "valid")
    log.info(f"Generated data (data_loader_config synthetic; nothing read from data_root): one "
             f"training and one validation batch made in memory in {time.perf_counter() - t0:.1f} "
             f"s and served for each of the {data.describe_generated_counts()}")
    return Loaders(CachedBatchLoader(train_batch, sampler, local_batch, device, memory_format),
                   CachedBatchLoader(valid_batch, valid_sampler, local_batch, torch.device("cpu")),
                   sampler, sampler.steps, n_train, n_valid)
