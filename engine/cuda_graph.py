"""The training step captured once as a CUDA graph and replayed (``train_graph.py``; what
capture asks of the step: docs/performance.md, "CUDA graphs"). ``StepGraph`` holds the static
buffers and runs the eager warm-up steps, the capture and the replays through ``CudaGraphOps``;
tests drive the same logic on a CPU through a stand-in with the same three methods."""
from __future__ import annotations

import contextlib
import logging
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from observe.memory import NullProbe
from settings.errors import ConfigError, TrainingError

if TYPE_CHECKING:  # annotations only: the settings are read by name
    from settings.config import Config

log = logging.getLogger(__name__)

DDP_WARMUP_STEPS = 11  # eager DDP iterations before a full-backward capture (PyTorch docs)
DDP_SAMPLE_EVERY = 100  # DDP times every 100th iteration with CUDA events (its reducer's rate)


def capture_warmup_steps(cfg: Config, ddp: bool) -> int:
    """The eager steps before capture: ``graph_warmup_steps``, under DDP at least 11 and neither 99
    nor 0 modulo 100 (DDP syncs on iterations it timed: its first 10 and every 100th)."""
    if not ddp:
        return cfg.graph_warmup_steps
    warmup = max(cfg.graph_warmup_steps, DDP_WARMUP_STEPS)

    def clash(w):
        return (w + 1) % DDP_SAMPLE_EVERY in (0, 1)

    if clash(warmup):
        lo = next(w for w in range(warmup, 0, -1) if not clash(w))
        hi = next(w for w in range(warmup, warmup + 3) if not clash(w))
        raise ConfigError(f"graph_warmup_steps={warmup} under DDP puts iteration {warmup + 1}, "
                          f"the captured one, next to one that DDP times with CUDA events (every "
                          f"{DDP_SAMPLE_EVERY}th): choose {lo} or {hi}")
    return warmup


def check_can_capture(cfg: Config, device: torch.device, model_parallel: bool):
    """Refuse, before anything is written, what a captured step cannot run."""
    if device.type != "cuda":
        raise ConfigError(f"train_graph.py captures the training step as a CUDA graph and needs "
                          f"a CUDA GPU; this run's device is {device.type}: run train.py with the "
                          f"same arguments")
    if model_parallel:
        raise ConfigError(f"train_graph.py trains data-parallel only; tensor_parallel="
                          f"{cfg.tensor_parallel} x context_parallel={cfg.context_parallel}: use "
                          f"train_mp.py")
    if cfg.fsdp:
        raise ConfigError("train_graph.py does not capture an FSDP step (its per-block "
                          "all-gathers and reduce-scatters allocate, free and wait on other "
                          "streams, which a CUDA graph cannot hold): run train.py with --fsdp, or "
                          "train_graph.py without --fsdp (DDP)")
    if cfg.enable_jit:
        raise ConfigError("train_graph.py captures the eager step; enable_jit (torch.compile) "
                          "is not combined with it: drop --enable_jit, or use train.py for "
                          "torch.compile")


class CudaGraphOps:
    """The CUDA side of ``StepGraph``: one side stream for warm-up and capture."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def side_stream(self):
        """Run the block on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def capture(self, fn, clear) -> SimpleNamespace:
        """Record the kernels ``fn`` launches (``clear`` was done before): ``replay()`` launches
        them, ``outputs`` then hold the latest replay's values."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's threads go on making CUDA calls during the capture
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        return SimpleNamespace(replay=graph.replay, outputs=out)

    synchronize = staticmethod(torch.cuda.synchronize)


class StepGraph:
    """``step(x, y, probe)``: one training step through ``body(x, y, probe)`` (returning its
    output tensors), ``clear()`` after each eager one (the captured backward then allocates the
    gradients in the graph's pool): ``warmup_steps`` eager calls on the side stream, then a
    capture and replays; one log line compares the first ``timed`` replays with eager steps."""

    def __init__(self, body, clear, ops, warmup_steps: int, timed: int = 5):
        self.body, self.clear, self.ops = body, clear, ops
        self.warmup_steps, self.timed = warmup_steps, timed
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None  # what the graph reads
        self.graph: SimpleNamespace | None = None  # CudaGraphOps.capture's
        self.calls = 0
        self.last_mode = ""  # "eager", "capture" or "replay": what the latest call did
        self.eager_s: list[float] = []
        self.replay_s: list[float] = []

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, x: torch.Tensor, y: torch.Tensor, probe=NullProbe()):
        self._copy_in(x, y)
        if not self.captured and self.calls < self.warmup_steps:
            self.last_mode = "eager"
            # (the first step, which initialises lazily, is not timed)
            with self._timed(self.eager_s, on=self.calls > 0), self.ops.side_stream():
                out = self.body(*self.static, probe)
                self.clear()
        else:
            self.last_mode = "replay" if self.captured else "capture"
            if not self.captured:
                self.clear()
                took = []
                with self._timed(took):
                    self.graph = self.ops.capture(lambda: self.body(*self.static, NullProbe()),
                                                  self.clear)
                log.info(f"CUDA graph: the training step captured after {self.calls} eager steps "
                         f"in {took[0]:.2f} s")
            timed = len(self.replay_s) < self.timed
            with self._timed(self.replay_s, on=timed):
                self.graph.replay()
            if timed and len(self.replay_s) == self.timed:
                log.info(self.speedup_line())
            out = self.graph.outputs  # the same tensors every step, rewritten by each replay
        self.calls += 1
        return out

    def _copy_in(self, x, y):
        if self.static is None:  # in the batches' memory format (channels-last or not)
            self.static = (torch.empty_like(x), torch.empty_like(y))
        for buf, t, name in zip(self.static, (x, y), ("input", "target")):
            if t.shape != buf.shape or t.dtype != buf.dtype or t.device != buf.device:
                raise TrainingError(
                    f"a CUDA graph replays fixed shapes: this {name} batch is {tuple(t.shape)} "
                    f"{t.dtype} on {t.device}, the captured one {tuple(buf.shape)} {buf.dtype} "
                    f"on {buf.device}; keep every batch the same size (or use train.py)")
            buf.copy_(t, non_blocking=True)

    @contextlib.contextmanager
    def _timed(self, times: list[float], on: bool = True):  # (between device syncs)
        if on:
            self.ops.synchronize()
            t0 = time.perf_counter()
        yield
        if on:
            self.ops.synchronize()
            times.append(time.perf_counter() - t0)

    def speedup_line(self) -> str:
        replay = sum(self.replay_s) / len(self.replay_s)
        line = f"CUDA graph: step {1e3 * replay:.2f} ms replayed"
        if self.eager_s:
            eager = sum(self.eager_s) / len(self.eager_s)
            line += (f", {1e3 * eager:.2f} ms eager ({len(self.eager_s)} warm-up steps): "
                     f"{eager / replay:.2f}x")
        return line
