"""Each science problem's data behind one interface that the loaders use, found by the class of
the run's config (``register(config_class, data_class)``, done by the module that knows the data:
``datapipe/era5.py``, ``datapipe/cosmo.py``, or a new problem's own file).

A data class is made from the config (``data_class(cfg)``) and answers:

- ``shuffle``: whether the sampler permutes the training indices (False where every index is a
  fresh random sample anyway, such as a random crop);
- ``row_bands``: whether training samples can be cut to a band of image rows (``rows``), as a
  model-parallel rank of the ViT reads them;
- ``missing()``: what ``data_root`` lacks of a data set (empty: it is there);
- ``synthesize()``: write synthetic files of the real format under ``data_root``, marked as such
  (``datapipe.synthetic.SYNTHETIC_MARK``);
- ``synthetic_files()``: the files ``synthesize`` writes, relative to ``data_root`` (a data class
  without it claims none: a marked synthetic ``data_root`` of it is then never replaced);
- ``datasets(rows)``: the (training, validation) datasets read from the files;
- ``generated_counts()``, ``describe_generated_counts()``, ``generated_batch(keys, split, rows)``:
  ``data_loader_config: synthetic``, batches made in memory (numpy, float32, raw values).

A problem's module imports datapipe.synthetic (and what imports it) only where used: importing
the package must not import datapipe.synthetic, which also runs as a script (python -m
datapipe.synthetic) and would then run a second copy of itself.
"""
from __future__ import annotations

from settings.registry import ByConfigClass

_DATA = ByConfigClass("data set", "datapipe.data_sets.register")
register = _DATA.register
data_set = _DATA.make  # the data of ``cfg``'s problem
