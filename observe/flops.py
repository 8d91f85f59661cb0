"""Model FLOPs of a training step (docs/performance.md, "Model FLOPs and MFU"); the GPU peaks
that turn them into MFU are in ``run_log.py``, which logs it."""


def training_flops(forward: int, first: int) -> int:
    """Training FLOPs (forward + backward) of one sample of the serial model from its forward
    FLOPs and those of its first layer (the task counts both: ``forward_flops``): 3 x forward,
    the backward of a layer costing twice its forward. Under tensor/context parallelism the
    replica's ranks share each sample's FLOPs, so the total per sample is the same."""
    return 3 * forward - first  # the first layer computes no input gradient
