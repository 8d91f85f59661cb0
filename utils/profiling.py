"""NVTX ranges for Nsight Systems, no-ops when no profiler listens.

The ``nvtx`` package works with no GPU (torch.cuda.nvtx raises on a CPU build). With
``enable_manual_profiling`` the CUDA profiler API brackets a window of steps, for
``nsys profile -c cudaProfilerApi``.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:  # optional: ranges become no-ops
    _nvtx = None


def nvtx_range(name: str):
    return _nvtx.annotate(name) if _nvtx is not None else contextlib.nullcontext()


class ProfilerWindow:
    """Starts the CUDA profiler at step ``start`` and stops it ``length`` steps later."""

    def __init__(self, enabled: bool, start: int, length: int = 30):
        self.enabled = enabled and torch.cuda.is_available()
        self.start, self.stop = start, start + length
        self.active = False

    def step(self, iteration: int):
        if not self.enabled:
            return
        if iteration == self.start and not self.active:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            self.active = True
        elif iteration == self.stop and self.active:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self.active = False
