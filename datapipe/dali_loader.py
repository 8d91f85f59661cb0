"""NVIDIA DALI loaders (``data_loader_config`` dali-lowmem / dali-inmem), as docs/performance.md
("DALI loaders") describes them. One pipeline definition per model serves a GPU (``device_id``)
and CPU threads (``device_id=None``). The epoch's keys reach the Python workers through
``EpochKeys``: the engine sets the sampler's epoch after the workers started. A partial last
batch (validation) is filled with repeats of the last key and cut back; an error a worker raises
on the data ends the run as that error (``worker_error``).
"""
from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import platform
import tempfile
import weakref
from typing import NamedTuple, TYPE_CHECKING

import numpy as np
import torch

from datapipe.cosmo_data import CosmoCropDataset
from datapipe.era5_data import ERA5Dataset
from datapipe.rotations import ROTATIONS, channel_plan
from settings import errors
from settings.errors import ConfigError
from settings.signals import held, release_ignored, signal_number

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

INSTALL = "pip install -r requirements-dali.txt"
PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64")}  # where nvidia-dali wheels exist
# The grid part of a rotation: new axis i is old axis perm[i]; one transpose branch per perm.
PERMS = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))


def import_dali():
    """The DALI modules used here, or a ConfigError naming the install command."""
    system, machine = platform.system(), platform.machine()
    if (system, machine) not in PLATFORMS:
        raise ConfigError(f"data_loader_config=dali-* needs NVIDIA DALI ({INSTALL}), which is "
                          f"built for Linux x86_64 and aarch64 only, not {system} {machine}: "
                          f"use --data_loader_config lowmem or inmem")
    try:
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import feed_ndarray
    except ImportError as e:
        raise ConfigError(f"data_loader_config=dali-* needs NVIDIA DALI, which is not installed "
                          f"({e}): {INSTALL}, or use --data_loader_config lowmem or inmem") from None
    return fn, pipeline_def, feed_ndarray


class EpochKeys:
    """The (epoch, index) keys of one DALI epoch in a file in shared memory: written by the main
    process before the pipeline is reset, read by the sample callbacks in any process (it
    pickles as its path). Row 0 holds (DALI epoch number, key count)."""

    def __init__(self, capacity: int):
        d = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="dali_keys_", dir=d)
        os.close(fd)
        self.capacity = capacity
        self._table = np.memmap(self.path, dtype=np.int64, mode="w+", shape=(capacity + 1, 2))
        self._table[0] = (-1, 0)  # no epoch yet: every callback stops
        weakref.finalize(self, _remove, self.path, os.getpid())

    def __getstate__(self):
        return {"path": self.path, "capacity": self.capacity}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._table = np.memmap(self.path, dtype=np.int64, mode="r",
                                shape=(self.capacity + 1, 2))

    def write(self, dali_epoch: int, keys: np.ndarray):
        self._table[1:len(keys) + 1] = keys
        self._table[0] = (dali_epoch, len(keys))
        self._table.flush()

    def stop(self):
        """Callbacks not yet run raise StopIteration: an abandoned epoch ends at once."""
        self._table[0, 1] = 0

    def key(self, info) -> tuple[int, int]:
        dali_epoch, n = self._table[0]
        if info.epoch_idx != dali_epoch or info.idx_in_epoch >= n:
            raise StopIteration
        epoch, i = self._table[1 + info.idx_in_epoch]
        return int(epoch), int(i)


def _remove(path: str, owner: int):
    if os.getpid() == owner:  # not from a forked worker that exits
        os.remove(path)


def rotation_arguments(rot: int, vector_channels, n_channels: int):
    """Per-sample arguments of the DALI rotation: the transpose branch, the flips of the
    (D, H, W) axes, and for every output channel its source channel and sign."""
    perm, sign = ROTATIONS[rot]
    src, mul = channel_plan(ROTATIONS[rot], vector_channels, n_channels)
    flips = np.array([s < 0 for s in sign], np.int32)
    return (np.array(PERMS.index(tuple(perm)), np.int32), flips, np.array(src, np.int32),
            mul.copy())


class SampleSource:
    """A per-sample callback, which DALI runs in its Python workers (a parallel source) or in the
    main process; in a worker, the first call ignores the run's ``stop_signals``, which the worker
    was started holding back, and then lets them through. ERA5: the raw (x, y) pair of the key's
    step. Cosmology: the rotation arguments of both fields, then with ``read`` the unrotated crops
    read from the file, else the crop's corner."""

    def __init__(self, dataset, keys: EpochKeys, stop_signals, read: bool = True):
        self.dataset, self.keys, self.read = dataset, keys, read
        self.stop_signals, self.owner, self.entered = tuple(stop_signals), os.getpid(), None

    def __call__(self, info):
        if self.entered != os.getpid():
            if os.getpid() != self.owner:
                release_ignored(self.stop_signals)
            self.entered = os.getpid()
        ds, key = self.dataset, self.keys.key(info)
        if isinstance(ds, ERA5Dataset):
            x, y = ds[key]
            return x.numpy(), y.numpy()
        (a, b, c), rot = ds.window(key)
        k, flips, src_x, mul_x = rotation_arguments(rot, ds.in_vec, ds.n_in)
        _, _, src_y, mul_y = rotation_arguments(rot, ds.out_vec, ds.n_out)
        out = (k, flips, src_x, mul_x, src_y, mul_y)
        if not self.read:
            return out + (np.array([a, b, c], np.int32),)
        s = ds.size
        nbody, hydro = ds._volumes()
        crop = np.s_[a:a + s, b:b + s, c:c + s]
        return out + (np.asarray(nbody[(slice(ds.n_in),) + crop], np.float32),
                      np.asarray(hydro[(slice(ds.n_out),) + crop], np.float32))


def _repeat(array, n):
    batch = [array] * n  # the same volume in every slot: referenced, not copied
    return lambda: batch


def _rotate(fn, v, k, flips, src, mul, vector_channels, n_channels, gpu: bool):
    """DALI operators turning a (C, D, H, W) crop (layout CDHW): transpose branch ``k``, flips,
    then the vector channels re-ordered and signed. Exact: only moves and sign changes."""
    # One of six transposes per sample: DALI conditionals run each branch on its samples only.
    g = v
    for j in range(1, len(PERMS)):
        if k == j:
            g = fn.transpose(v, perm=[0] + [1 + p for p in PERMS[j]], transpose_layout=False)
    g = fn.flip(g, depthwise=flips[0], vertical=flips[1], horizontal=flips[2])
    if not vector_channels:
        return g
    chans = []
    for c in range(n_channels):
        if c in vector_channels:
            m = mul[c].gpu() if gpu else mul[c]
            chans.append(g[src[c]] * m)  # (D, H, W)
        else:
            chans.append(g[c])
    return fn.stack(*chans, axis=0)  # (C, D, H, W)


class Handoff(NamedTuple):
    """How one batch passes from the pipeline to torch (see ``handoff``)."""

    stream: object  # torch's current CUDA stream, on which the copy is queued; None on CPU
    run_stream: object  # passed to ``pipe.run``: the stream its outputs are bound to, or None
    share: bool  # wrap DALI's output buffer (DLPack) instead of copying it


def handoff(device, exec_dynamic: bool) -> Handoff:
    """The hand-off of the next batch on ``device``; ``exec_dynamic``: the pipeline runs DALI's
    dynamic executor (the default, and that of every pipeline built here). On a GPU, torch's
    current stream, read per batch: ``pipe.run(stream)`` makes it wait for the batch (``pipe.run()``
    would wait on the host), and ``feed_ndarray`` queues the copy on it, which DALI's stream waits
    for before reusing the source. Copied, not wrapped (DLPack): DALI's outputs follow its own
    stream, which does not wait for torch's, so a wrapped buffer dropped by the engine could be
    refilled while the step reading it is still queued. On CPU the dynamic executor gives every
    batch its own buffer, which the tensor wraps; the legacy executor's are reused, so copied."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return Handoff(stream, stream if exec_dynamic else None, share=False)
    return Handoff(None, None, share=exec_dynamic)


class DALILoader:
    """Batches (x, y) of one pipeline in the order of ``sampler``, like a DataLoader over it."""

    def __init__(self, build_pipeline, sampler, batch_size, keys: EpochKeys, device, feed,
                 stop_signals=()):
        self.build_pipeline, self.sampler, self.b = build_pipeline, sampler, batch_size
        self.keys, self.device, self.feed = keys, device, feed
        self.stop_signals = tuple(stop_signals)  # held back while the build starts the workers
        self.pipe = None
        self.dali_epoch = 0
        self.open = False  # an epoch started and not run to its end

    def __len__(self):
        return -(-len(self.sampler) // self.b)

    def _start_epoch(self) -> int:
        keys = np.array([k if isinstance(k, tuple) else (0, k) for k in self.sampler],
                        np.int64).reshape(-1, 2)
        n = len(keys)
        if n % self.b:  # fill the last batch; its extra samples are cut off
            keys = np.concatenate([keys, np.repeat(keys[-1:], self.b - n % self.b, axis=0)])
        if self.pipe is None:
            self.keys.write(self.dali_epoch, keys)
            self.pipe = self.build_pipeline()
            before = set(multiprocessing.active_children())
            try:
                with held(self.stop_signals):
                    self.pipe.build()
            except RuntimeError as e:
                raise ConfigError(f"DALI could not build its pipeline on {self.device} "
                                  f"({str(e).strip().splitlines()[0]}): check the DALI build "
                                  f"against the CUDA driver ({INSTALL}), or use "
                                  f"--data_loader_config lowmem or inmem") from None
            # DALI stops a dropped pipeline's Python workers by a request through its queues,
            # then a second later by terminate() (SIGTERM, which they ignore: a stop signal is
            # the main process's), and waits for them: one that missed the request (stuck in a
            # hung read, or the request lost in queues an interrupt left half updated) is killed.
            for p in set(multiprocessing.active_children()) - before:
                p.terminate = p.kill
        else:
            self._finish()
            self.dali_epoch += 1
            self.keys.write(self.dali_epoch, keys)  # before the reset that schedules the reads
            self.pipe.reset()
        self.open = True
        return n

    def _to_torch(self, out, plan: Handoff) -> torch.Tensor:
        """One pipeline output (as one dense tensor: a view) on the device: the loader's one copy
        of the batch, or none with ``plan.share`` (CPU)."""
        if plan.share:
            return torch.from_dlpack(out)
        t = torch.empty(out.shape(), dtype=torch.float32, device=self.device)
        self.feed(out, t, cuda_stream=plan.stream)
        return t

    def _finish(self):
        """Run the pipeline to its StopIteration (cut short if the epoch was abandoned)."""
        if not self.open:
            return
        self.keys.stop()
        try:
            while True:  # bound to torch's stream too: the host does not wait for dropped batches
                self.pipe.run(handoff(self.device, self.pipe.exec_dynamic).run_stream)
        except StopIteration:
            pass
        self.open = False

    def __iter__(self):
        try:
            n = self._start_epoch()
            for step in range(len(self)):
                plan = handoff(self.device, self.pipe.exec_dynamic)
                x, y = (self._to_torch(o.as_tensor(), plan) for o in self.pipe.run(plan.run_stream))
                keep = min(self.b, n - step * self.b)
                yield x[:keep], y[:keep]  # views: no copy
            self._finish()
        except GeneratorExit:  # abandoned between batches: the pipeline is as it should be
            raise
        except BaseException as e:
            # Raised inside DALI's calls (by a signal handler: a stop request, a stall timeout),
            # the pipeline may be half built or half run: the next pass builds a new one.
            self.pipe, self.open, self.dali_epoch = None, False, 0
            raised = worker_error(e)
            if raised is not None:
                raise raised from None
            raise


def worker_error(e: BaseException):
    """The project's own error (``settings.errors``: a DataError on a non-finite value, ...)
    that a Python worker raised, which DALI passes on as a plain Exception holding the worker's
    traceback as text, remade from its last line; None for any other exception."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if "traceback received from worker" not in str(e) or not lines:
        return None
    name, _, message = lines[-1].partition(": ")
    cls = getattr(errors, name.removeprefix("settings.errors."), None) \
        if name.startswith("settings.errors.") else None
    if not (isinstance(cls, type) and issubclass(cls, errors.UserError)):
        return None
    return cls(message)


def build_dali_loaders(cfg: Config, reference, local_batch: int, device):
    """Loaders of one data-parallel rank with DALI pipelines, on the samplers and datasets of
    ``reference(host config)``: ``build_loaders`` in the matching PyTorch mode."""
    fn, pipeline_def, feed = import_dali()
    host = copy.copy(cfg)
    host.data_loader_config = cfg.data_loader_config.removeprefix("dali-")
    ref = reference(host)
    inmem = host.data_loader_config == "inmem"
    gpu = device.type == "cuda"
    workers = 0 if inmem else cfg.num_data_workers  # in memory: a copy, no reads to overlap
    settings = dict(batch_size=local_batch, num_threads=max(1, cfg.num_data_workers),
                    device_id=(device.index if device.index is not None
                               else torch.cuda.current_device()) if gpu else None,
                    prefetch_queue_depth=cfg.prefetch_depth, py_num_workers=max(1, workers),
                    # forking after CUDA is initialised is unsafe; on CPU fork starts fastest
                    py_start_method="spawn" if gpu else "fork", enable_conditionals=True)
    source = dict(batch=False, parallel=workers > 0)
    stop = [signal_number(name) for name in cfg.stop_signals]  # ignored in the Python workers

    def era5_pipeline(dataset, keys):
        @pipeline_def(**settings)
        def pipe():
            x, y = fn.external_source(source=SampleSource(dataset, keys, stop), num_outputs=2,
                                      **source)
            return (x.gpu(), y.gpu()) if gpu else (x, y)

        return pipe

    def cosmo_pipeline(dataset, keys):
        s = dataset.size

        @pipeline_def(**settings)
        def pipe():
            outs = fn.external_source(source=SampleSource(dataset, keys, stop, not inmem),
                                      num_outputs=7 if inmem else 8, **source)
            k, flips, src_x, mul_x, src_y, mul_y = outs[:6]
            if inmem:  # the crop cut from the volumes held in memory, passed without a copy
                nbody, hydro = dataset._volumes()
                vols = [fn.external_source(source=_repeat(v, local_batch), batch=True,
                                           no_copy=True, layout="CDHW") for v in (nbody, hydro)]
                x, y = (fn.slice(v, outs[6], np.array([s, s, s], np.int32), axes=[1, 2, 3],
                                 out_of_bounds_policy="error") for v in vols)
            else:
                x, y = (fn.reshape(v, layout="CDHW") for v in outs[6:])
            if gpu:
                x, y = x.gpu(), y.gpu()
            x = _rotate(fn, x, k, flips, src_x, mul_x, dataset.in_vec, dataset.n_in, gpu)
            y = _rotate(fn, y, k, flips, src_y, mul_y, dataset.out_vec, dataset.n_out, gpu)
            return x, y

        return pipe

    pipelines = {ERA5Dataset: era5_pipeline, CosmoCropDataset: cosmo_pipeline}

    def loader(torch_loader, sampler):
        dataset = torch_loader.dataset
        make = pipelines.get(type(dataset))
        if make is None:
            raise ConfigError(f"data_loader_config={cfg.data_loader_config}: no DALI pipeline "
                              f"reads {type(dataset).__name__}: use --data_loader_config lowmem "
                              f"or inmem")
        keys = EpochKeys(-(-len(sampler) // local_batch) * local_batch)
        return DALILoader(make(dataset, keys), sampler, local_batch, keys, device, feed, stop)

    return dataclasses.replace(ref, train=loader(ref.train, ref.train_sampler),
                               valid=loader(ref.valid, ref.valid.sampler))
