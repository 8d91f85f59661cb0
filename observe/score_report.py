"""What scoring a trained model writes (docs/scoring.md), from the ``Report`` a task's scoring
fills in: numbers and the plots' layout only; matplotlib draws them here where it is installed
(without it the plots are skipped, with ``NO_PLOTS`` among the notes)."""
from __future__ import annotations

import csv
import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

NO_PLOTS = "note: matplotlib is not installed, so the plots were skipped: pip install matplotlib"


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
    xstep: float | None = None  # the distance between ticks on the x axis (24 for hours)


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
    ``figures``, the printed ``summary`` lines, ``notes`` (what was left out, and why) and
    further ``tables`` ({name: rows}, each also ``<name>.csv``)."""

    rows: list
    meta: dict
    scalars: list
    figures: list
    summary: list
    notes: list
    tables: dict = field(default_factory=dict)


def _plain(v):
    """A JSON value: numpy scalars as Python numbers, nan and inf as null."""
    v = v.item() if isinstance(v, np.generic) else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def draw(figure: Figure, path: str, subtitle: str = "") -> bytes:
    """Draw ``figure`` into the PNG ``path``; the file's bytes."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    n = max(1, len(figure.panels))
    cols = min(figure.columns, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, figure.panels):
        for label, x, y in panel.series:
            ax.plot(np.asarray(x, dtype=float), np.asarray(y, dtype=float), label=label)
        if panel.hline is not None:
            ax.axhline(panel.hline, color="grey", lw=0.8, ls="--")
        ax.set(xscale="log" if panel.logx else "linear", yscale="log" if panel.logy else "linear")
        if panel.xstep:
            ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(panel.xstep))
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if figure.panels and figure.panels[0].series:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{figure.title}\n{subtitle}" if subtitle else figure.title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)
    with open(path, "rb") as f:
        return f.read()


def write_report(report: Report, directory: str) -> list[str]:
    """Everything the report holds, into ``directory`` (made): ``scores.csv`` and each further
    table's ``<name>.csv`` (one row per line), ``scores.json`` (the meta, the notes, the rows and
    the further tables), one PNG per figure and the TensorBoard events (``tensorboard/``: the
    scalars and the plots, tagged ``Plots/<name>``); the paths written, relative to ``directory``."""
    os.makedirs(directory, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        report.notes.append(NO_PLOTS)
    tables = {name: [{k: _plain(v) for k, v in row.items()} for row in rows]
              for name, rows in {"scores": report.rows, **report.tables}.items()}
    for name, rows in tables.items():
        with open(os.path.join(directory, f"{name}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)  # None as an empty field
    written = [f"{name}.csv" for name in tables] + ["scores.json"]
    with open(os.path.join(directory, "scores.json"), "w") as f:
        json.dump({"meta": report.meta, "notes": report.notes, "rows": tables.pop("scores"),
                   **tables}, f, indent=1)
    from tensorboard.compat.proto.summary_pb2 import Summary

    from observe.tensorboard import Board

    board = Board(os.path.join(directory, "tensorboard"))
    for tag, value, step in report.scalars:
        if math.isfinite(value):
            board.scalar(tag, value, step)
    meta = report.meta
    caption = f"{os.path.basename(meta.get('checkpoint', ''))} (step {meta.get('step')})"
    if "initial_conditions" in meta:  # each plot names what it scores
        caption += f", {meta['initial_conditions']} initial conditions"
    for figure in report.figures if NO_PLOTS not in report.notes else ():
        png = draw(figure, os.path.join(directory, f"{figure.name}.png"), caption)
        written.append(f"{figure.name}.png")
        # also an image (IMAGES tab), the PNG as it is: its size and colour type read from the IHDR
        width, height = struct.unpack(">II", png[16:24])
        channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(png[25], 4)  # grey, RGB, grey + alpha, RGBA
        image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png)
        value = Summary.Value(tag=f"Plots/{figure.name}", image=image)
        board.writer.file_writer.add_summary(Summary(value=[value]), 0)
    board.close()
    return written + ["tensorboard/"]
