"""The cosmology problem's data (the U-Net), registered for ``UNetConfig``: crops of volume files
(``datapipe.cosmo_data``), synthetic ones (``datapipe.synthetic``), in memory (``generated_data``)."""
from __future__ import annotations

import os

# datapipe.generated_data and datapipe.synthetic are imported where used (datapipe/data_sets.py)
from datapipe.cosmo_data import CosmoCropDataset, crop_settings
from datapipe.data_sets import register
from settings.config import UNetConfig


class CosmoData:
    shuffle = False  # every index is already a fresh random crop
    row_bands = False

    def __init__(self, cfg: UNetConfig):
        self.cfg = cfg

    def missing(self) -> list[str]:
        """The volume files training needs under data_root and that are not there."""
        c = self.cfg
        return [name for name in (c.train_file, c.val_file)
                if not os.path.exists(os.path.join(c.data_root, name))]

    def synthesize(self):
        from datapipe import synthetic
        c = self.cfg
        synthetic.make_cosmo(c.data_root, train_size=c.synthetic_size[0],
                             val_size=c.synthetic_size[1], seed=c.seed,
                             train_name=c.train_file, val_name=c.val_file, mark=synthetic.RUN_MARK)

    def synthetic_files(self) -> list[str]:
        """What ``synthesize`` writes, relative to data_root."""
        from datapipe import synthetic
        return list(synthetic.cosmo_plan(train_name=self.cfg.train_file, val_name=self.cfg.val_file))

    def datasets(self, rows=None):
        c = self.cfg
        kw = dict(crop_settings(c), inmem=c.data_loader_config == "inmem")
        train = CosmoCropDataset(os.path.join(c.data_root, c.train_file), nsamples=c.Nsamples,
                                 augment=True, **kw)
        valid = CosmoCropDataset(os.path.join(c.data_root, c.val_file),
                                 nsamples=c.Nsamples_val, augment=False, **kw)
        return train, valid

    def generated_counts(self) -> tuple[int, int]:
        return self.cfg.Nsamples, self.cfg.Nsamples_val

    def describe_generated_counts(self) -> str:
        n_train, n_valid = self.generated_counts()
        return f"{n_train} training and {n_valid} validation samples (Nsamples, Nsamples_val)"

    def generated_batch(self, keys, split: str, rows=None):
        from datapipe import generated_data
        return generated_data.cosmo_batch(self.cfg, keys, split)


register(UNetConfig, CosmoData)
