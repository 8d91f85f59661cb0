"""Each science problem in one place: what differs between them, behind one interface the
engine asks and never branches around (``tasks/era5.py``: the ViT on ERA5; ``tasks/cosmo.py``: the
U-Net on cosmology volumes). A task is made from the run's config (``make_task(cfg)``, by the
config's class) and answers:

- ``build_model()``: the serial model (``networks/``), which knows nothing of parallelism;
- ``device_batch(x, y)``: the first operation of the step on a batch as the loader delivers it;
- ``loss``: per-sample losses, or partial sums of them (``tasks.losses``); ``loss_name``: it in words;
- ``metric_sums(pred, y)``, ``metric_lines``, ``metric_scalars``: validation metrics, summed over
  samples so that sums all-reduced over ranks and divided by the count are exact means however
  the samples were split; ``baseline_name``, ``baseline_pred(x, y)``: the naive forecast the log
  prints beside them; ``picture(x, y, pred)``: the validation picture for TensorBoard;
- ``sample_shape()``: one input sample's shape (the memory estimate's, ``observe.memory``);
- ``forward_flops()``, ``flops_per_sample(epoch)``: model FLOPs (``observe.flops``);
  ``fp32_in_tf32()``: whether its fp32 FLOPs run in TF32 (the peak MFU divides by);
- ``from_reference(sd, model)``: the tutorial's weights under this model's names (``init_from``);
- ``shards_model``: whether train_mp.py can split the model over tensor/context-parallel ranks.

and, where its problem has something to say, what ``tasks.base.Task`` (every task derives from
it) answers with torch's defaults: ``memory_format``, ``compile_options``, ``forward_kernels``,
``blocks``, ``training_loss`` and ``forecast`` (one forward pass; the ViT's rollout training
overrides them), ``skill`` and ``score``.

Its data is the data room's (``datapipe.data_sets``, registered for the same config class), and
its settings are its config class's (``settings.config``: fields, bounds and ``check()``). A new
problem is one module that registers all three.
"""
from tasks import cosmo, era5  # noqa: F401  (each registers its task)
from tasks.registry import make_task, register

__all__ = ["make_task", "register"]
