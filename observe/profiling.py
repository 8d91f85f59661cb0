"""Where a run's time goes (docs/performance.md, "Profiling" and "Seconds to the first step"):
named ranges, the CUDA profiler API's window of steps for Nsight Systems (``ProfilerWindow``), a
torch.profiler trace that also works without a GPU (``TraceWindow``), and how long the start
took to the end of the first step, by part (``StartClock``)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

import torch

from observe.logging_utils import Nothing
from settings.errors import ConfigError

try:
    import nvtx as _nvtx
except ImportError:  # optional: NVTX ranges become no-ops
    _nvtx = None

log = logging.getLogger("train")


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range and a torch.profiler range of the same name around the block (next to free
    while no profiler listens). The ``nvtx`` package works without a GPU (torch.cuda.nvtx raises
    on a CPU build); without it the NVTX half is a no-op."""
    nvtx = _nvtx.annotate(name) if _nvtx is not None else contextlib.nullcontext()
    with torch.profiler.record_function(name), nvtx:
        yield


NSYS_ENV = "NSYS_PROFILING_SESSION_ID"  # set by Nsight Systems in the process it profiles


class ProfilerWindow:
    """Starts the CUDA profiler at step ``start`` and stops it ``length`` steps later, for
    ``nsys profile -c cudaProfilerApi``, which records only between the two."""

    def __init__(self, start: int, length: int = 30):
        self.start, self.stop = start, start + length

    @classmethod
    def for_run(cls, requested: bool, device: torch.device, iteration: int,
                steps_per_epoch: int, total_steps: int, length: int = 30):
        """``length`` steps from the second epoch's first step (after compilation, loader
        start-up and autotuning), or from this launch's first when resumed past it; cut at the
        run's end. Open when asked for or under Nsight Systems (``nsys -c cudaProfilerApi`` then
        needs no flag); else ``Nothing``."""
        under_nsys = bool(os.environ.get(NSYS_ENV))
        if requested and device.type != "cuda":
            log.warning("enable_manual_profiling: no CUDA device, so no CUDA profiler window "
                        "(nsys records CUDA work); for a trace on %s use --profile_trace DIR",
                        device.type)
        if not (requested or under_nsys) or device.type != "cuda":
            return Nothing()
        start = max(steps_per_epoch, iteration)
        length = min(length, total_steps - start)
        if length <= 0:
            log.warning("CUDA profiler window: the run ends before step %d, so nothing is "
                        "recorded; train longer (--num_epochs 2 or more)", start + 1)
            return Nothing()
        log.info("CUDA profiler window: steps %d-%d%s (nsys -c cudaProfilerApi records these)",
                 start + 1, start + length,
                 "" if requested else f", opened because {NSYS_ENV} is set")
        return cls(start, length)

    def step(self, iteration: int):
        """Before step ``iteration`` (each step once, in order)."""
        if iteration in (self.start, self.stop):
            torch.cuda.synchronize()
            (torch.cuda.profiler.start if iteration == self.start else torch.cuda.profiler.stop)()


def unused_path(path: str) -> str:
    """``path``, or ``<stem>_2<ext>``, ``<stem>_3<ext>``... when it exists: traces of earlier
    runs are never overwritten."""
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}_{n}{ext}"
    return path


class TraceWindow:
    """A ``torch.profiler.profile`` over ``wait + warmup + active`` steps from step ``start``,
    stopped after them or at ``end`` (the run's last step), whichever comes first.

    ``step(it)`` takes the index of the step about to run: once before an epoch's first step
    and after every step (repeated indices are ignored). Each call after the start ends one
    profiler step, so a step's range covers its wait for the batch, forward, backward and
    optimizer."""

    def __init__(self, directory: str, rank: int, start: int, end: int, wait: int = 1,
                 warmup: int = 1, active: int = 3):
        self.dir, self.rank, self.start, self.end = directory, rank, start, end
        self.wait, self.warmup, self.length = wait, warmup, wait + warmup + active
        self.schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
        self.prof = None
        self.written: list[str] = []

    @classmethod
    def for_run(cls, directory: str, rank: int, iteration: int, steps_per_epoch: int,
                total_steps: int):
        """From the second epoch's first step, or from this launch's first (``iteration``) when
        fewer steps than the window follow the first epoch or the run was resumed past it.
        ``Nothing`` when ``directory`` is empty; ``validate`` checked it."""
        if not directory:
            return Nothing()
        # Kineto (torch.profiler's tracer) writes lines of its own to stderr, between the run's
        # (USDT: ... profiler_start, STAGE: ...); read when it starts, level 6 is above them
        # all. KINETO_LOG_LEVEL set by the user is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        os.makedirs(directory, exist_ok=True)
        window = cls(directory, rank, steps_per_epoch, total_steps)
        if iteration > steps_per_epoch or total_steps - steps_per_epoch < window.length:
            window.start = iteration
        return window

    def avoid(self, iteration: int):
        """Keep step ``iteration`` out of the window (``train_graph.py``'s capture: the profiler's
        own CUDA calls would break it), by starting the window after it when it would hold it."""
        if self.start <= iteration < self.start + self.length:
            self.start = iteration + 1

    def step(self, iteration: int):
        if self.prof is None and iteration == self.start:
            self.prof = torch.profiler.profile(  # CPU, and CUDA when there is a GPU
                schedule=self.schedule, on_trace_ready=self._write, record_shapes=False)
            self.prof.start()
        elif self.prof is not None and iteration != self.last:
            self.prof.step()
            if iteration - self.start >= self.length or iteration >= self.end:
                self.prof.stop()
                if not self.written:
                    log.warning(f"no torch.profiler trace written: the run ended "
                                f"{iteration - self.start} steps after step {self.start}, before "
                                f"the traced steps (it needs {self.length})")
                self.prof = None
                self.start = -1  # the window runs once
        self.last = iteration  # (the next call with the same index is ignored)

    def _write(self, prof):
        # At the end of the active steps, inside prof.step() (or stop()). A profile's results
        # are saved once, so TensorBoard's profile plugin gets a copy under its own file name.
        first = self.start + self.wait + self.warmup
        path = unused_path(os.path.join(self.dir, f"trace_rank{self.rank}_step{first}.json"))
        prof.export_chrome_trace(path)
        tb_dir = os.path.join(self.dir, "tensorboard")
        os.makedirs(tb_dir, exist_ok=True)
        ms = time.time_ns() // 10**6
        while os.path.exists(tb_path := os.path.join(tb_dir,
                                                     f"rank{self.rank}.{ms}.pt.trace.json")):
            ms += 1
        shutil.copyfile(path, tb_path)
        self.written.append(path)
        log.info(f"Profiler trace written: {path} (TensorBoard profile in {tb_dir})")


# ---------------------------------------------------------------------- the start's seconds

_IMPORTED = time.time()


def process_start_time() -> float:
    """Wall-clock time (``time.time()``) at which this process started: the kernel's record of
    it on Linux, else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, in parens
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: after boot (proc(5))
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started  # the same clock as starttime
        return min(time.time() - age, _IMPORTED)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def compile_cache_dir() -> str:
    """Where torch.compile keeps its caches in this process."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts of torch
        from torch._inductor.utils import cache_dir
    return cache_dir()


def use_compile_cache_dir(path: str) -> str:
    """Point torch.compile's caches at ``path`` (made if missing) unless it is empty, before the
    first compile; the directory the caches are in. A path with white space is refused:
    torch's compiler command lines split it."""
    if path:
        path = os.path.abspath(os.path.expanduser(path))
        if any(c.isspace() for c in path):
            raise ConfigError(f"compile_cache_dir={path!r} has white space, which torch.compile's "
                              f"compiler commands split: choose a directory without spaces")
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return compile_cache_dir()


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of torch.compile's FX-graph cache in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0
    inductor = counters.get("inductor", {})
    return int(inductor.get("fxgraph_cache_hit", 0)), int(inductor.get("fxgraph_cache_miss", 0))


class StartClock:
    """Marks the end of each part of a run's start (``mark(name)``) and says, after the first
    step, how long each took (``lines()``)."""

    def __init__(self, start: float | None = None, clock=time.time):
        self.clock = clock
        self.start = process_start_time() if start is None else start
        self.marks: list[tuple[str, float]] = []
        self.compile_dir: str | None = None  # set when the model is compiled

    def mark(self, name: str):
        """The part called ``name`` ends now (it began where the previous one ended)."""
        self.marks.append((name, self.clock()))

    def lines(self, width: int = 100) -> list[str]:
        """The total, then the parts, wrapped at ``width`` characters (a line with its time
        stamp fits a terminal)."""
        total = (self.marks[-1][1] if self.marks else self.clock()) - self.start
        out = [f"Start: {total:.1f} s to the end of the first step, by part:"]
        begins = [self.start] + [end for _, end in self.marks]
        for (name, end), begin in zip(self.marks, begins):
            item = f"{name} {end - begin:.1f} s"
            if len(out) > 1 and len(out[-1]) + 2 + len(item) <= width:
                out[-1] += f", {item}"
            else:
                out.append(f"  {item}")
        if self.compile_dir is not None:
            hits, misses = compile_cache_counts()
            out.append(f"  compile caches {self.compile_dir}: {hits} hits, {misses} misses (a "
                       f"later run of this config reuses them)")
        return out
