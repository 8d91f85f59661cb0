"""Each science problem in one place: what differs between them, behind one interface the
engine asks and never branches around (``tasks/era5.py``: the ViT on ERA5; ``tasks/cosmo.py``: the
U-Net on cosmology volumes). A task is made from the run's config (``make_task(cfg)``, by the
config's class) and answers:

- ``build_model()``: the serial model (``networks/``), which knows nothing of parallelism;
- ``device_batch(x, y)``: the first operation of the step on a batch as the loader delivers it;
- ``loss``: per-sample losses, or partial sums of them (``tasks.losses``);
- ``metric_sums(pred, y)``, ``metric_lines``, ``metric_scalars``: validation metrics, summed over
  samples so that sums all-reduced over ranks and divided by the count are exact means however
  the samples were split; ``baseline_name``, ``baseline_pred(x, y)``: the naive forecast the log
  prints beside them; ``picture(x, y, pred)``: the validation picture for TensorBoard;
- ``forward_flops()``, ``flops_per_sample()``: model FLOPs (``observe.flops``);
  ``fp32_in_tf32()``: whether its fp32 FLOPs run in TF32 (the peak MFU divides by);
- ``from_reference(sd, model)``: the tutorial's weights under this model's names (``init_from``);
- ``shards_model``: whether train_mp.py can split the model over tensor/context-parallel ranks.

and, where its problem has something to say (``tasks.base.Task``, which every task derives from,
answers with torch's defaults):

- ``memory_format(device)``: the layout of the model's weights and of the batches on the
  device (``torch.contiguous_format`` or ``torch.channels_last_3d``: the U-Net's on a GPU), and
  why (for the log); ``compile_options(memory_format)``: the options torch.compile
  (``enable_jit``) is given;
- ``forward_kernels(device, dtype)``: a factory of the context the forward pass runs under (the
  ViT's attention kernel, ``tasks.attention``);
- ``blocks(model)``: the units the model is built of (the ViT's transformer blocks, the U-Net's
  encoder and decoder stages; by default none: the whole model is one unit): sharded as units
  under ``fsdp``, their weights gathered together just before they run; their linear layers
  are the ones ``fp8_linears`` converts; each is compiled on its own under ``compile_blocks``.

Its data is the data room's (``datapipe.data_sets``, registered for the same config class), and
its settings are its config class's (``settings.config``: fields, bounds and ``check()``). A new
problem is one module that registers all three.
"""
from tasks import cosmo, era5  # noqa: F401  (each registers its task)
from tasks.registry import make_task, register

__all__ = ["make_task", "register"]
