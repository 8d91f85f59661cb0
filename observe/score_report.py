"""What scoring a trained model writes (docs/scoring.md), from the ``Report`` a task's scoring
fills in: numbers and the plots' layout only; matplotlib draws them here, imported when a plot
is drawn (``check_matplotlib`` tells first, in one line, when it is missing)."""
from __future__ import annotations

import csv
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from settings.errors import ConfigError


@dataclass
class Panel:
    """One chart: ``series`` is a list of (label, x values, y values)."""

    title: str
    xlabel: str
    ylabel: str
    series: list
    logx: bool = False
    logy: bool = False
    hline: float | None = None  # a reference level drawn across (1 for ratios)


@dataclass
class Figure:
    """One PNG (``<name>.png``): its panels in a grid of ``columns``."""

    name: str
    title: str
    panels: list
    columns: int = 2


@dataclass
class Report:
    """The scores of one run: the table's ``rows`` (dicts, the columns in the order of their
    keys), ``meta`` (what was scored, and how), TensorBoard ``scalars`` as (tag, value, step),
    ``figures``, the printed ``summary`` lines and ``notes`` (what was left out, and why)."""

    rows: list
    meta: dict
    scalars: list
    figures: list
    summary: list
    notes: list


def check_matplotlib():
    """Refuse, in one line, before any work, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("matplotlib is not installed, and the scores' plots need it: pip "
                          "install -r requirements-plots.txt") from None


def _plain(v):
    """A JSON value: numpy scalars as Python numbers, nan and inf as null."""
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def write_table(report: Report, directory: str):
    """``scores.csv`` (one row per line) and ``scores.json`` (the meta, the notes and the rows)."""
    rows = [{k: _plain(v) for k, v in row.items()} for row in report.rows]
    with open(os.path.join(directory, "scores.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)  # None as an empty field
    with open(os.path.join(directory, "scores.json"), "w") as f:
        json.dump({"meta": report.meta, "notes": report.notes, "rows": rows}, f, indent=1)


def draw(figure: Figure, path: str) -> bytes:
    """Draw ``figure`` into the PNG ``path``; the file's bytes."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    n = max(1, len(figure.panels))
    cols = min(figure.columns, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, figure.panels):
        for label, x, y in panel.series:
            ax.plot(np.asarray(x, dtype=float), np.asarray(y, dtype=float), label=label)
        if panel.hline is not None:
            ax.axhline(panel.hline, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log" if panel.logx else "linear")
        ax.set_yscale("log" if panel.logy else "linear")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if figure.panels and figure.panels[0].series:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(figure.title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)
    with open(path, "rb") as f:
        return f.read()


def write_events(report: Report, logdir: str, plots: dict):
    """The report's scalars, and its ``plots`` ({figure name: PNG bytes}) as images tagged
    ``Plots/<name>`` (the IMAGES tab), as TensorBoard events under ``logdir``. The PNGs go in as
    they are (no decoding and encoding again): their size and colour type read from the IHDR."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    from observe.tensorboard import Board

    board = Board(logdir)
    for tag, value, step in report.scalars:
        if math.isfinite(value):
            board.scalar(tag, value, step)
    for name, png in plots.items():
        width, height = struct.unpack(">II", png[16:24])
        channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(png[25], 4)  # grey, RGB, grey + alpha, RGBA
        image = Summary.Image(height=height, width=width, colorspace=channels,
                              encoded_image_string=png)
        value = Summary.Value(tag=f"Plots/{name}", image=image)
        board.writer.file_writer.add_summary(Summary(value=[value]), 0)
    board.close()


def write_report(report: Report, directory: str) -> list[str]:
    """Everything the report holds, into ``directory`` (made): the table, one PNG per figure and
    the TensorBoard events (``tensorboard/``: the scalars, and the PNGs as images). The paths
    written, relative to ``directory``."""
    os.makedirs(directory, exist_ok=True)
    write_table(report, directory)
    written = ["scores.csv", "scores.json"]
    plots = {}
    for figure in report.figures:
        plots[figure.name] = draw(figure, os.path.join(directory, f"{figure.name}.png"))
        written.append(f"{figure.name}.png")
    write_events(report, os.path.join(directory, "tensorboard"), plots)
    return written + ["tensorboard/"]
