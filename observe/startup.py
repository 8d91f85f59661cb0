"""How long a run took to start: the seconds from the process's start (the kernel's record of
it, so the imports are counted) to the end of its first step, by part, logged after that step;
and where torch.compile keeps its caches. Both are described in docs/performance.md ("Seconds
to the first step")."""
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

    def lines(self, width: int = 100) -> list[str]:
        """The log's lines: the total, then the parts, wrapped at ``width`` characters (so that a
        line with its time stamp fits a terminal)."""
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
