"""The ERA5 problem's data (the ViT), registered for ``ViTConfig``: year files and statistics
(``datapipe.era5_data``), synthetic ones (``datapipe.synthetic``), in memory (``generated_data``)."""
from __future__ import annotations

import os

# datapipe.generated_data and datapipe.synthetic are imported where used (datapipe/data_sets.py)
from datapipe.data_sets import register
from datapipe.era5_data import ERA5Dataset
from settings.config import ViTConfig


class ERA5Data:
    shuffle = True
    row_bands = True  # a model-parallel rank reads only the image rows it computes on

    def __init__(self, cfg: ViTConfig):
        self.cfg = cfg

    def missing(self) -> list[str]:
        """What training needs under data_root and is not there: the year files' directories
        and the normalisation statistics (a whole directory named when it is absent)."""
        root = self.cfg.data_root
        absent = [name for name in ("train/", "valid/", "stats/")
                  if not os.path.isdir(os.path.join(root, name.rstrip("/")))]
        if "stats/" not in absent:
            absent += [f"stats/{name}.npy" for name in ("global_means", "global_stds")
                       if not os.path.isfile(os.path.join(root, "stats", f"{name}.npy"))]
        return absent

    def synthesize(self):
        from datapipe import synthetic
        c = self.cfg
        synthetic.make_era5(c.data_root, img_size=tuple(c.img_size),
                            steps_per_year=c.synthetic_steps_per_year, seed=c.seed,
                            mark=synthetic.RUN_MARK)

    def synthetic_files(self) -> list[str]:
        """What ``synthesize`` writes, relative to data_root (make_era5's default years)."""
        from datapipe import synthetic
        return list(synthetic.era5_plan())

    def datasets(self, rows=None):
        """Training and validation sets; ``rows`` limits the training samples to that band of
        image rows (validation keeps whole images: its metrics and pictures are of the whole
        image)."""
        c = self.cfg
        kw = dict(data_root=c.data_root, img_size=c.img_size, dt=c.dt, n_in=c.n_in_channels,
                  n_out=c.n_out_channels, inmem=c.data_loader_config == "inmem",
                  steps=c.rollout_max)
        train = ERA5Dataset(os.path.join(c.data_root, "train"), limit_nsamples=c.limit_nsamples,
                            rows=rows, **kw)
        valid = ERA5Dataset(os.path.join(c.data_root, "valid"),
                            limit_nsamples=c.limit_nsamples_val, **kw)
        return train, valid

    def generated_counts(self) -> tuple[int, int]:
        from datapipe import generated_data
        return generated_data.era5_counts(self.cfg)

    def describe_generated_counts(self) -> str:
        from datapipe import generated_data
        n_train, n_valid = self.generated_counts()
        return (f"{n_train} training and {n_valid} validation samples (limit_nsamples, "
                f"limit_nsamples_val; unset: {generated_data.ERA5_STEPS_PER_YEAR}, a year of "
                f"6-hourly steps)")

    def generated_batch(self, keys, split: str, rows=None):
        from datapipe import generated_data
        return generated_data.era5_batch(self.cfg, [i for _, i in keys], split, rows)


register(ViTConfig, ERA5Data)
