"""The header lines of a run's log: the device and ranks, the model and its size, the
model-parallel layout, and the data and steps the run will train on."""
import logging

log = logging.getLogger(__name__)


def log_run_header(model, rt, loaders, total_steps: int, layout_summary: str | None):
    """``rt``: the run's ranks, device and batch sizes (``engine.runtime.Runtime``); ``loaders``:
    its sample and step counts (``datapipe.data_loader.Loaders``)."""
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Device {rt.device}, {rt.world_size} rank(s), {rt.dp_size} data-parallel; model "
             f"{type(model).__name__} with {n_params / 1e6:.2f} M parameters"
             + (" on this rank" if rt.groups is not None else ""))
    if rt.groups is not None:
        log.info("Model-parallel layout: " + rt.groups.describe())
        log.info(layout_summary)
    log.info(f"{loaders.n_train} training samples, {loaders.n_valid} validation samples; "
             f"{loaders.steps_per_epoch} steps per epoch of {rt.global_batch} samples "
             f"({rt.local_batch} per rank); {total_steps} steps in all")
