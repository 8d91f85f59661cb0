"""Random cubic crops of N-body (input) and hydro (target) volumes, with rotation augmentation
(docs/data.md: the format, and what a sample is). A crop's window and rotation are a function of
(seed, epoch, sample index) alone: the same whatever the worker count, or after a resume. Read
from the file, each channel goes straight to where the rotation sends it in the batch buffer, and
the crop is turned there (``rotate_in_place``); non-finite values are refused once per batch (in
memory: once, at load).
"""
from __future__ import annotations

import itertools
import os

import h5py
import numpy as np
import torch

from datapipe.batch_dataset import BatchReadDataset, check_stored_dtype, finite_sums, read_float32
from datapipe.rotations import ROTATIONS, channel_plan, rotate_in_place, rotate_into
from settings.errors import ConfigError, DataError


SLAB_BYTES = 256 * 2**20  # host memory of one read while loading (float32 planes of a channel)


def load_field(path: str, name: str, n: int, device, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` channels of dataset ``name`` of ``path`` as a (n, L, L, L) tensor of
    ``dtype`` on ``device``, read as float32 slab by slab (at most ``SLAB_BYTES`` of host memory
    at a time), each slab checked for non-finite values and, in half precision, for values
    beyond the type's range."""
    with h5py.File(path, "r") as f:
        ds = f[name]
        side = ds.shape[1]
        out = torch.empty((n, *ds.shape[1:]), dtype=dtype, device=device)
        planes = max(1, SLAB_BYTES // (4 * side * side))
        for c in range(n):
            for a in range(0, side, planes):
                b = min(side, a + planes)
                slab = torch.from_numpy(read_float32(ds, (slice(c, c + 1), slice(a, b))))[0]
                if not bool(slab.isfinite().all()):
                    raise DataError(f"{path}: '{name}' holds non-finite values: repair the file")
                dest = out[c, a:b]
                dest.copy_(slab)  # the cast to the storage type, on the device
                if dtype != torch.float32 and not bool(dest.isfinite().all()):
                    raise ConfigError(f"{path}: '{name}' holds values beyond the range of "
                                      f"{str(dtype).removeprefix('torch.')} (largest "
                                      f"{torch.finfo(dtype).max:g}): use --device_volume_dtype "
                                      f"bfloat16 or float32")
    return out


def crop_settings(cfg) -> dict:
    """The CosmoCropDataset arguments of a U-Net config but the volumes, count and augmentation."""
    return dict(size=cfg.data_size, n_in=cfg.n_in_channels, n_out=cfg.n_out_channels,
                nbody_vector_channels=cfg.nbody_vector_channels,
                hydro_vector_channels=cfg.hydro_vector_channels, seed=cfg.seed)


class CosmoCropDataset(BatchReadDataset):
    def __init__(self, path, size, nsamples, n_in=4, n_out=5, nbody_vector_channels=(),
                 hydro_vector_channels=(), augment=True, seed=0, inmem=False, volumes=None):
        """``volumes``: the (Nbody, Hydro) arrays, already in memory (generated data), instead of
        the file; ``path`` then only names them in messages."""
        self.path, self.size, self.nsamples = path, size, nsamples
        self.n_in, self.n_out = n_in, n_out
        self.in_vec, self.out_vec = tuple(nbody_vector_channels), tuple(hydro_vector_channels)
        self.augment, self.seed = augment, seed
        self._handle, self._pid = None, None
        self._arrays = None
        if volumes is not None:
            self.box = self._check_shapes(volumes[0].shape, volumes[1].shape)
            self._arrays = (volumes[0][:n_in], volumes[1][:n_out])
            return
        self.box = self._check()
        if inmem:
            self._arrays = tuple(load_field(path, name, n, "cpu", torch.float32).numpy()
                                 for name, n in (("Nbody", n_in), ("Hydro", n_out)))

    def _check(self) -> int:
        if not os.path.exists(self.path):
            raise DataError(f"{self.path} not found: set --data_root to the directory holding "
                            f"the cosmology files (or COSMO_DATA_ROOT), or generate synthetic "
                            f"volumes with python -m datapipe.synthetic cosmo --out DIR and "
                            f"train on them with --data_root DIR --train_file train.h5 "
                            f"--val_file valid.h5 (the names it writes)")
        try:
            with h5py.File(self.path, "r") as f:
                missing = [k for k in ("Nbody", "Hydro") if k not in f]
                if missing:
                    raise DataError(f"{self.path} lacks dataset(s) {missing} (found: {list(f.keys())})")
                sx, sy = f["Nbody"].shape, f["Hydro"].shape
                for name in ("Nbody", "Hydro"):
                    check_stored_dtype(self.path, name, f[name])
        except OSError as e:
            raise DataError(f"{self.path} is not a readable HDF5 file ({e}): replace it") from None
        return self._check_shapes(sx, sy)

    def _check_shapes(self, sx, sy) -> int:
        if len(sx) != 4 or len(sy) != 4 or sx[1:] != sy[1:] or len(set(sx[1:])) != 1:
            raise DataError(f"{self.path}: Nbody {sx} and Hydro {sy} must be (C, L, L, L) boxes "
                            f"of the same side")
        if sx[0] < self.n_in or sy[0] < self.n_out:
            raise DataError(f"{self.path}: Nbody has {sx[0]} channels and Hydro {sy[0]}; the "
                            f"model needs {self.n_in} and {self.n_out}")
        if sx[1] < self.size:
            raise DataError(f"{self.path}: box side {sx[1]} is smaller than data_size={self.size}")
        return sx[1]

    def _volumes(self):
        if self._arrays is not None:
            return self._arrays
        if self._pid != os.getpid():  # h5py handles must not cross a fork: open once per process
            f = h5py.File(self.path, "r")
            self._handle, self._pid = (f["Nbody"], f["Hydro"]), os.getpid()
        return self._handle

    def __len__(self):
        return self.nsamples

    def window(self, key):
        """Corner of the crop and rotation index of the sample of ``key``, an (epoch, index) pair
        or an index (epoch 0). Validation crops are the same at every validation."""
        epoch, i = key if isinstance(key, tuple) else (0, key)
        rng = np.random.default_rng([self.seed, int(self.augment), epoch if self.augment else 0, i])
        corner = rng.integers(0, self.box - self.size + 1, size=3)
        rot = int(rng.integers(0, len(ROTATIONS))) if self.augment else 0
        return corner, rot

    @property
    def sample_shapes(self):
        """Shapes of one input and one target: (n_in, s, s, s) and (n_out, s, s, s)."""
        s = self.size
        return (self.n_in, s, s, s), (self.n_out, s, s, s)

    def read_batch(self, keys, x: np.ndarray, y: np.ndarray):
        """Samples ``keys`` ((epoch, index) pairs, or indices: epoch 0) into ``x`` (B, n_in, s, s, s)
        and ``y`` (B, n_out, s, s, s), float32 C-contiguous arrays the caller owns."""
        s = self.size
        nbody, hydro = self._volumes()
        corners = []
        for j, key in enumerate(keys):
            (a, b, c), rot = self.window(key)
            corners.append((int(a), int(b), int(c)))  # printed as plain numbers
            crop = np.s_[a:a + s, b:b + s, c:c + s]
            for field, n, vec, out in ((nbody, self.n_in, self.in_vec, x[j]),
                                       (hydro, self.n_out, self.out_vec, y[j])):
                if self._arrays is not None:  # a view of the stored volume, copied once
                    rotate_into(field[(slice(n),) + crop], ROTATIONS[rot], vec, out)
                elif not rot:
                    field.read_direct(out, (slice(n),) + crop)
                else:  # read into place, the channels where the rotation sends them; then turned
                    source, signs = channel_plan(ROTATIONS[rot], vec, n)
                    for lo, hi, first in _runs(source):
                        field.read_direct(out, (slice(first, first + hi - lo),) + crop,
                                          np.s_[lo:hi])
                    rotate_in_place(out, ROTATIONS[rot], signs)
        # One reduction over the batch: a NaN or infinity anywhere makes the sum non-finite.
        # Only then are the crops looked at one by one (a huge finite sum may overflow too).
        if self._arrays is None and not finite_sums(x, y):
            for j, corner in enumerate(corners):
                if not (np.isfinite(x[j]).all() and np.isfinite(y[j]).all()):
                    raise DataError(f"non-finite values in {self.path} in the crop at {corner}: "
                                    f"repair the file")


def _runs(source):
    """``(lo, hi, first)`` for each run of output channels lo..hi-1 whose sources are the
    consecutive channels first, first + 1, ...: one read each."""
    runs = (list(g) for _, g in itertools.groupby(enumerate(source), lambda p: p[1] - p[0]))
    return [(run[0][0], run[-1][0] + 1, run[0][1]) for run in runs]
