"""Run logging: one readable line per event to stdout and <run dir>/out.log, rank 0 only; other
ranks report warnings and errors only, prefixed with their rank."""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys

FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
EVERY_RANK_UP_TO = 8  # per-rank figures: listed one by one up to this many ranks, summarised above


class Nothing:
    """A do-nothing stand-in (a board on every rank but 0, no trace window, no memory probe):
    every method call does nothing and returns a context that does nothing."""

    def __getattr__(self, name):
        if name.startswith("__"):  # (copy, pickle: as for any object)
            raise AttributeError(name)
        return lambda *args, **kwargs: contextlib.nullcontext()


def setup_logging(rank: int = 0, log_file: str | None = None):
    """The root logger's handlers, in place of any set before."""
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file and rank == 0:
        os.makedirs(os.path.dirname(log_file), exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="a"))  # a resumed run continues it
    logging.basicConfig(
        format=FORMAT if rank == 0 else f"%(asctime)s - [rank {rank}] %(levelname)s - %(message)s",
        level=logging.INFO if rank == 0 else logging.WARNING, handlers=handlers, force=True)


def wrapped(head: str, items: list[str], width: int = 100, indent: str = "    ") -> list[str]:
    """``head``, then the comma-separated ``items`` on lines of at most ``width`` characters."""
    lines, line = [head], indent
    for k, item in enumerate(items):
        piece = item + ("," if k < len(items) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = indent
        line += ("" if line == indent else " ") + piece
    return lines + ([line] if line.strip() else [])


def channel_lines(head: str, names, values, base=None, base_name: str = "",
                  spec: str = ".4f") -> list[str]:
    """One value per channel (``name value``, or ``name value / baseline`` beside the
    ``base_name`` baseline's), under ``head``, wrapped to fit a terminal."""
    if base is None:
        return wrapped(f"{head}:", [f"{n} {v:{spec}}" for n, v in zip(names, values)])
    return wrapped(f"{head}, model / {base_name}:",
                   [f"{n} {v:{spec}} / {b:{spec}}" for n, v, b in zip(names, values, base)])


def over_ranks(values, spec: str) -> str:
    """Every rank's value up to ``EVERY_RANK_UP_TO`` ranks; beyond, the lowest and the highest
    with their ranks and the median (a line readable at hundreds of ranks)."""
    values = list(values)
    if len(values) <= EVERY_RANK_UP_TO:
        return ", ".join(f"{v:{spec}}" for v in values)
    low = min(range(len(values)), key=values.__getitem__)
    high = max(range(len(values)), key=values.__getitem__)
    return (f"min {values[low]:{spec}} (rank {low}), median {statistics.median(values):{spec}}, "
            f"max {values[high]:{spec}} (rank {high}) of {len(values)} ranks")


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
