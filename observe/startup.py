"""How long a run took to start: the seconds from the process's start to the end of its first
step, by part, as one log line after that step:

    Start: 31.4 s to the end of the first step, by part:
      imports and set-up 6.2 s, data 2.1 s, loaders 0.2 s, model 1.4 s, optimizer and logs 0.1 s,
      first batch 0.3 s, first step 21.1 s
      compile caches /tmp/torchinductor_alice: 12 hits, 0 misses (a later run ...)

(the parts wrapped to fit a terminal; the last line only when the model is compiled; the first
batch's part includes the fetch of the batch after it, fetched ahead of the first step).
The process's start is the kernel's record of it (``/proc/self/stat``), so the imports before
any of the project's code ran are counted; elsewhere the clock starts when this module is
imported. The first step's time includes what a first step does once: compiling the model,
choosing cuDNN's convolution algorithms for each new shape, CUDA's lazy loading of kernels.

torch.compile keeps what it compiled in its caches (FX graphs, the autograd graphs, Triton
kernels) under ``$TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``: a second
run of the same config on the same node finds them there and starts in seconds.
``compile_cache_dir`` (or the environment variable itself) puts them elsewhere: on a shared file
system ($SCRATCH) every rank of a job and every later job on any node reads the same caches
(entries are written whole and renamed into place, so ranks writing at once are safe).
"""
from __future__ import annotations

import os
import time

from settings.errors import ConfigError

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
        return cache_dir()
    except ImportError:  # older layouts of torch
        from torch._inductor.utils import cache_dir
        return cache_dir()


def use_compile_cache_dir(path: str) -> str:
    """Point torch.compile's caches at ``path`` (made if missing) unless it is empty; return the
    directory the caches are in. Call before the first compile. A path with white space is
    refused (ConfigError): torch's compiler command lines split it."""
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

    def parts(self) -> list[tuple[str, float]]:
        out, t = [], self.start
        for name, end in self.marks:
            out.append((name, end - t))
            t = end
        return out

    def lines(self, width: int = 100) -> list[str]:
        """The log's lines: the total, then the parts, wrapped at ``width`` characters (so that a
        line with its time stamp fits a terminal)."""
        total = (self.marks[-1][1] if self.marks else self.clock()) - self.start
        out = [f"Start: {total:.1f} s to the end of the first step, by part:"]
        for name, seconds in self.parts():
            item = f"{name} {seconds:.1f} s"
            if len(out) > 1 and len(out[-1]) + 2 + len(item) <= width:
                out[-1] += f", {item}"
            else:
                out.append(f"  {item}")
        if self.compile_dir is not None:
            hits, misses = compile_cache_counts()
            out.append(f"  compile caches {self.compile_dir}: {hits} hits, {misses} misses (a "
                       f"later run of this config reuses them)")
        return out
