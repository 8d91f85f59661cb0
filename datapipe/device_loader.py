"""``data_loader_config: device`` (U-Net): the cosmology volumes held in the memory of the device
the run trains on, each batch's crops cut and rotated there (what for, and when it refuses:
docs/performance.md, "Cosmology volumes on the device").

Per batch the host draws each sample's window (corner and rotation, ``CosmoCropDataset.window``)
and sends the (B, 4) table to the device. New grid axis k of a crop runs along old axis
``perm[k]``, backwards where ``sign[k] < 0``, so voxel (i0, i1, i2) of crop j is the volume's
voxel at linear offset ``off[j, 0, i0] + off[j, 1, i1] + off[j, 2, i2]``: a (B, s, s, s) index
summed from three (B, s) rows. One advanced-indexing gather per field per batch,
``volume.view(C, L^3)[src[:, :, None, None, None], index[:, None]]``, takes the crops with the
vector channels re-ordered (``datapipe.rotations.channel_plan``); one multiplication by the
(B, C) signs follows only when a sample turns a vector component backwards.

On a CPU with float32 storage (``method="copy"``) each crop is copied through its rotated view
instead (``CropGather.copy``). Both give the bits of the ``lowmem`` loaders (never iterated).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from datapipe.cosmo_data import CosmoCropDataset, load_field
from datapipe.rotations import ROTATIONS, channel_plan, rotate_into
from settings.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import UNetConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_DTYPE = torch.int64


# ----------------------------------------------------------------------------- memory

@dataclass
class VolumeNeed:
    """What ``data_loader_config: device`` holds on the device: the volumes of each split
    (``sides``: their box sides) with ``channels`` (Nbody, Hydro) channels, in ``dtype``, and
    one batch of ``batch`` crops of side ``size`` while it is cut."""

    sides: tuple[int, ...]
    channels: tuple[int, int]
    dtype: str = "float32"
    batch: int = 0
    size: int = 0

    def volume_bytes(self, dtype: str | None = None) -> int:
        itemsize = DTYPES[dtype or self.dtype].itemsize
        return sum(self.channels) * sum(side**3 for side in self.sides) * itemsize

    def batch_bytes(self) -> int:
        """A batch being cut: its float32 crops, the int64 index, and (half precision) the
        gathered crops before their cast."""
        voxels = self.batch * self.size**3
        half = DTYPES[self.dtype].itemsize if self.dtype != "float32" else 0
        return voxels * (sum(self.channels) * (4 + half) + INDEX_DTYPE.itemsize)

    def describe(self) -> str:
        boxes = " and ".join(f"{side}^3" for side in self.sides)
        return (f"{self.channels[0]} + {self.channels[1]} channels of {boxes}")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def check_fits(need: VolumeNeed, free: int | None, where: str):
    """Refuse (ConfigError, one line) when the volumes and a batch do not fit in ``free`` bytes of
    ``where``'s memory; ``free`` None (unknown) lets the run go on."""
    total = need.volume_bytes() + need.batch_bytes()
    if free is None or total <= free:
        return
    choices = []
    if need.dtype == "float32":
        choices.append(f"--device_volume_dtype bfloat16 (halves the volumes: "
                       f"{_gb(need.volume_bytes('bfloat16'))})")
    choices.append("--data_loader_config lowmem (each crop read from disk)")
    raise ConfigError(f"data_loader_config=device: the training and validation volumes take "
                      f"{_gb(need.volume_bytes())} in {need.dtype} ({need.describe()}) and a "
                      f"batch {_gb(need.batch_bytes())}, but {where} has {_gb(free)} free: use "
                      f"{' or '.join(choices)}")


def host_available() -> int | None:
    """Bytes of host memory available to this process: MemAvailable of /proc/meminfo, within the
    limit of its cgroup (v2) when that sets one; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next(line.strip().split("::", 1)[1] for line in f if line.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(base, "memory.current")) as f:
            return min(available, max(0, int(limit) - int(f.read())))
    except (OSError, ValueError, IndexError, StopIteration):  # no cgroup v2, or no limit (max)
        return available


def free_memory(device: torch.device) -> int | None:
    """Free bytes of ``device``'s memory: on a GPU what the driver reports free on it (other
    processes' use counted), on a CPU the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return host_available()
    return None


# ----------------------------------------------------------------------------- the volumes

class CropGather:
    """The volumes of one split on the device, and the batch cut from them (module docstring):
    ``gather(windows)`` with ``windows`` a (B, 4) int64 array of (corner x, y, z, rotation), by
    ``method`` "copy" (CPU, float32 storage) or "gather", in ``memory_format`` (channels-last:
    the gather's index runs over (B, s, s, s, C))."""

    def __init__(self, dataset: CosmoCropDataset, device, dtype: torch.dtype,
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.dataset, self.device, self.size = dataset, torch.device(device), dataset.size
        self.memory_format = memory_format
        self.method = "copy" if self.device.type == "cpu" and dtype == torch.float32 else "gather"
        self._threads = None  # the crops' copies, over torch's intra-op threads (CPU)
        self.fields = []  # (flat volume (C, L^3), source channels (24, C), signs (24, C), host signs)
        for name, n, vec in (("Nbody", dataset.n_in, dataset.in_vec),
                             ("Hydro", dataset.n_out, dataset.out_vec)):
            volume = load_field(dataset.path, name, n, device, dtype)
            # for each of the 24 rotations, the source channel of every output channel and its sign
            plans = [channel_plan(rot, vec, n) for rot in ROTATIONS]
            src, mul = np.array([p[0] for p in plans]), np.stack([p[1] for p in plans])
            self.fields.append((volume.view(n, -1), torch.from_numpy(src).to(device),
                                torch.from_numpy(mul).to(device), mul))
        side = dataset.box
        self.volumes = tuple(f[0].view(f[0].shape[0], side, side, side) for f in self.fields)
        self.perm = torch.tensor([p for p, _ in ROTATIONS], dtype=INDEX_DTYPE, device=device)
        self.sign = torch.tensor([s for _, s in ROTATIONS], dtype=INDEX_DTYPE, device=device)
        self.stride = torch.tensor([side * side, side, 1], dtype=INDEX_DTYPE, device=device)
        self.steps = torch.arange(self.size, dtype=INDEX_DTYPE, device=device)

    def windows(self, keys) -> np.ndarray:
        """(B, 4) corners and rotations of the samples ``keys`` (as ``read_batch`` takes them)."""
        out = np.empty((len(keys), 4), np.int64)
        for j, key in enumerate(keys):
            out[j, :3], out[j, 3] = self.dataset.window(key)
        return out

    def index(self, w: torch.Tensor) -> torch.Tensor:
        """(B, 1, s, s, s) linear voxel offsets of the rotated crops of ``w`` (on the device)."""
        rot = w[:, 3]
        perm, sign = self.perm[rot], self.sign[rot]  # (B, 3): new axis k runs along old perm[k]
        start = w[:, :3].gather(1, perm)  # the corner's coordinate along old axis perm[k]
        pos = torch.where(sign[:, :, None] > 0, self.steps, self.size - 1 - self.steps)
        off = (start[:, :, None] + pos) * self.stride[perm][:, :, None]  # (B, 3, s)
        return (off[:, 0, :, None, None] + off[:, 1, None, :, None]
                + off[:, 2, None, None, :])[:, None]

    def gather(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.method == "copy":
            return self.copy(windows)
        w = torch.from_numpy(windows).to(self.device, non_blocking=True)
        index, rot = self.index(w), w[:, 3]
        rots = windows[:, 3]
        out = []
        for flat, src, mul, host_mul in self.fields:
            if self.memory_format == torch.channels_last_3d:  # (B, s, s, s, C) in memory, as
                # a (B, C, s, s, s) view: channels-last
                crops = flat[src[rot][:, None, None, None, :], index[:, 0, ..., None]
                             ].permute(0, 4, 1, 2, 3)
            else:
                crops = flat[src[rot][:, :, None, None, None], index]  # (B, C, s, s, s): one gather
            signs = mul[rot][:, :, None, None, None] if (host_mul[rots] < 0).any() else None
            if crops.dtype == torch.float32:
                if signs is not None:  # some vector component turned backwards
                    crops.mul_(signs)
            else:  # half precision storage: float32 batches
                crops = crops.float() if signs is None else torch.mul(crops, signs)
            out.append(crops.contiguous(memory_format=self.memory_format))  # (already is)
        return out[0], out[1]

    def copy(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``windows`` in host memory, each crop copied through its rotated view
        (vector channels turned), the crops spread over torch's intra-op threads (numpy's copies
        release the GIL)."""
        s, ds = self.size, self.dataset
        vecs = (ds.in_vec, ds.out_vec)
        outs = [torch.empty((len(windows), v.shape[0], s, s, s), memory_format=self.memory_format)
                for v in self.volumes]
        views = [(v.numpy(), o.numpy(), vec) for v, o, vec in zip(self.volumes, outs, vecs)]

        def crop(j):
            (a, b, c), rot = windows[j, :3], ROTATIONS[int(windows[j, 3])]
            for volume, out, vec in views:
                rotate_into(volume[:, a:a + s, b:b + s, c:c + s], rot, vec, out[j])

        if torch.get_num_threads() <= 1 or len(windows) <= 1:
            for j in range(len(windows)):
                crop(j)
        else:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(torch.get_num_threads(),
                                                   thread_name_prefix="crops")
            list(self._threads.map(crop, range(len(windows))))
        return outs[0], outs[1]


class DeviceCropLoader:
    """Batches (x, y) of the crops of ``sampler``'s keys, ``batch_size`` at a time (the last one
    possibly smaller), cut on the device: like a DataLoader over the same sampler."""

    never_waits = True  # cuts each batch in this process, from memory: no data wait (engine)

    def __init__(self, gather: CropGather, sampler, batch_size: int):
        self.gather, self.sampler, self.batch_size = gather, sampler, batch_size

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        keys = iter(self.sampler)
        while batch := list(itertools.islice(keys, self.batch_size)):
            yield self.gather.gather(self.gather.windows(batch))


def build_device_loaders(cfg: UNetConfig, reference, local_batch: int, device,
                         memory_format: torch.memory_format = torch.contiguous_format):
    """Loaders of one data-parallel rank cutting their crops from volumes held on ``device``, in
    ``memory_format``; datasets, samplers and checks are those of ``reference(host config)``,
    the ``lowmem`` loaders (never iterated)."""
    device = torch.device(device)
    host = copy.copy(cfg)
    host.data_loader_config, host.num_data_workers = "lowmem", 0
    ref = reference(host)
    train, valid = ref.train.dataset, ref.valid.dataset
    if not isinstance(train, CosmoCropDataset):  # (the config's rules refuse it first)
        raise ConfigError(f"data_loader_config=device holds cosmology volumes; "
                          f"{type(train).__name__} has none: use --data_loader_config lowmem "
                          f"or inmem")
    need = VolumeNeed(sides=(train.box, valid.box), channels=(train.n_in, train.n_out),
                      dtype=cfg.device_volume_dtype, batch=local_batch, size=cfg.data_size)
    check_fits(need, free_memory(device), str(device))
    t0 = time.perf_counter()
    dtype = DTYPES[cfg.device_volume_dtype]
    gathers = tuple(CropGather(d, device, dtype, memory_format=memory_format)
                    for d in (train, valid))
    log.info(f"Device loader: training and validation volumes ({need.describe()}) held on "
             f"{device} in {cfg.device_volume_dtype}, {_gb(need.volume_bytes())}, loaded in "
             f"{time.perf_counter() - t0:.1f} s; crops cut and rotated there (no workers)")
    return dataclasses.replace(ref, train=DeviceCropLoader(gathers[0], ref.train_sampler, local_batch),
                               valid=DeviceCropLoader(gathers[1], ref.valid.sampler, local_batch))
