"""The data of ``--data_loader_config synthetic`` (docs/performance.md: counts, what a rank
makes): the samples the synthetic generator (``datapipe.synthetic``) writes, made in memory. ERA5:
training sample i is step i of the seed's trajectory from the first training year (raw values),
validation samples follow the last training target, and the statistics are those of
``ERA5_STATS_STEPS`` steps spread over a year. Cosmology: the files' crops, cut by the dataset's
own code from the boxes of side ``synthetic_size`` (at least ``data_size``).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from datapipe import synthetic
from datapipe.cosmo_data import CosmoCropDataset, crop_settings
from datapipe.era5_data import check_rows

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import UNetConfig, ViTConfig

ERA5_STEPS_PER_YEAR = 1460  # 6-hourly steps in a year: the generated ERA5 sets' default size
ERA5_STATS_STEPS = 8  # steps, evenly spread over a year, behind the normalisation statistics


def era5_counts(cfg) -> tuple[int, int]:
    """(training samples, validation samples) of the generated ERA5 set."""
    return (cfg.limit_nsamples or ERA5_STEPS_PER_YEAR, cfg.limit_nsamples_val or ERA5_STEPS_PER_YEAR)


def _era5_start(cfg: ViTConfig) -> int:
    return (synthetic.YEARS["train"][0] - synthetic.EPOCH_YEAR) * cfg.synthetic_steps_per_year


def era5_batch(cfg: ViTConfig, indices, split: str, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``indices`` of ``split`` ("train" or "valid"): inputs (B, n_in, rows, W) and
    targets (B, n_out, rows, W), float32, raw values."""
    start = _era5_start(cfg)
    if split == "valid":
        start += era5_counts(cfg)[0] + cfg.dt  # after the last training target
    t = start + np.asarray(indices, dtype=np.int64)
    steps, where = np.unique(np.concatenate([t, t + cfg.dt]), return_inverse=True)
    fields = synthetic.era5_fields(steps, cfg.img_size, cfg.synthetic_steps_per_year, cfg.seed)
    band = slice(*check_rows(rows, cfg.img_size[0]))
    x = fields[where[: t.size], : cfg.n_in_channels, band]
    y = fields[where[t.size:], : cfg.n_out_channels, band]
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


@functools.lru_cache(maxsize=4)
def _era5_stats(img_size: tuple, steps_per_year: int, seed: int, start: int):
    steps = start + np.linspace(0, steps_per_year, ERA5_STATS_STEPS, endpoint=False).round()
    fields = synthetic.era5_fields(steps.astype(np.int64), img_size, steps_per_year, seed)
    fields = fields.astype(np.float64)
    return fields.mean(axis=(0, 2, 3)), fields.std(axis=(0, 2, 3))


def era5_stats(cfg: ViTConfig) -> tuple[np.ndarray, np.ndarray]:
    """Normalisation means and stds of the generated fields, as ``era5_data.load_stats`` returns
    them."""
    mean, std = _era5_stats(tuple(cfg.img_size), cfg.synthetic_steps_per_year, cfg.seed,
                            _era5_start(cfg))
    c = max(cfg.n_in_channels, cfg.n_out_channels)
    return (mean[:c, None, None].astype(np.float32), std[:c, None, None].astype(np.float32))


_cosmo_box = functools.lru_cache(maxsize=2)(synthetic.cosmo_box)  # made once per process


def cosmo_volumes(cfg: UNetConfig, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The (Nbody, Hydro) volumes of the generated ``split`` box, made once per process."""
    side = max(cfg.synthetic_size[0 if split == "train" else 1], cfg.data_size)
    return _cosmo_box(side, cfg.seed, split)


def cosmo_batch(cfg: UNetConfig, keys, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The crops ``keys`` ((epoch, index) pairs from the loader's sampler) of ``split``, cut from
    the generated box as the file-backed dataset would cut them."""
    dataset = CosmoCropDataset(f"<generated {split} box>", volumes=cosmo_volumes(cfg, split),
                               nsamples=cfg.Nsamples if split == "train" else cfg.Nsamples_val,
                               augment=split == "train", **crop_settings(cfg))
    return dataset.read(keys)
