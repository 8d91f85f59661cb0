"""The tutorial's single-GPU chapter on a real GPU, in one device call of under 9 minutes: the
optimised configs of the U-Net and the ViT (the device loader, compile, the throughput report,
the time to the first step, a second run on warm compile caches), the roofline, compiled
channels-last and fp8, tabulated beside the tutorial's A100 figures and the goals.

How to run it, the series (``SERIES``), the budget, the data, the table and the rows of the runs
that failed or were skipped (exit status 1): docs/performance.md ("Measuring on a GPU").
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks import gpu_data
from observe.profiling import unused_path
from settings.errors import OneLineParser, at_least, refuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 540.0  # one call: under the device's 10-minute command limit, with room to spare
MIN_RUN_S = 20.0  # no run starts with less than this left of the budget

# ---------------------------------------------------------------------------- the estimates
# From the GPU runs on an H200 (benchmarks/GPU.md): wall-clock samples/s of the U-Net at batch
# 64 with the device loader ~1500-1900; ViT at batch 16, bf16 + fused + compile with 8 workers 150.
START_S = 15.0  # process start to the first step: imports, CUDA context, model, loader
AUTOTUNE_S = 20.0  # cuDNN's autotuning of the U-Net's convolutions on a first step
COMPILE_S = 35.0  # torch.compile's first steps, caches cold
WARM_COMPILE_S = 10.0  # the same with the caches of an earlier run
REPORT_S = 25.0  # --throughput_report's 3 modes x 3 rounds of 20 batches, and its set-up
VIT_VALID = 47  # the 48-step validation file's pairs, per validation


def est(samples: float, rate: float, extra: float = 0.0) -> float:
    """Seconds of a run that processes ``samples`` at ``rate`` samples/s, plus ``extra``."""
    return round(START_S + extra + samples / rate)


# ---------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Run:
    """One row. ``key`` is "series/name" (the goals and the tutorial figures refer to it);
    ``script``: train.py or a Python file; ``kind``: "train" or "report" (a benchmark script
    that writes its result to ``--json``, ``markdown`` in it); ``data``: the data set it reads
    under --data ("cosmo", "era5" or None); ``est_s``: seconds on an H200."""

    key: str
    label: str
    script: str
    args: tuple[str, ...]
    est_s: float
    kind: str = "train"
    data: str | None = None

    @property
    def series(self) -> str:
        return self.key.split("/")[0]


UNET_OPT = ("--yaml_config", "config/UNet.yaml", "--config", "short_opt", "--num_epochs", "3",
            "--Nsamples", "1536", "--Nsamples_val", "256", "--data_loader_config", "device")
VIT_OPT = ("--config", "short_opt", "--limit_nsamples", "192", "--num_iters", "48",
           "--amp_mode", "bf16")
REPORT = ("--throughput_report",)
SERIES: dict[str, list[Run]] = {
    "unet": [
        Run("unet/short_opt", "short_opt (fp16, fused Adam, compile, memory format auto) with the "
            "device loader, + throughput report", "train.py", UNET_OPT + REPORT,
            est(3 * 1792, 1500, AUTOTUNE_S + COMPILE_S + REPORT_S), data="cosmo"),
    ],
    "vit": [
        Run("vit/short_opt", "short_opt in bf16: 8 workers, fused Adam, compile, attention auto, "
            "+ throughput report", "train.py", VIT_OPT + REPORT,
            est(48 * 16 + 4 * VIT_VALID, 150, COMPILE_S + REPORT_S), data="era5"),
        Run("vit/short_opt_again", "the same again: the compile caches of the run before",
            "train.py", VIT_OPT, est(48 * 16 + 4 * VIT_VALID, 150, WARM_COMPILE_S), data="era5"),
    ],
    "roofline": [
        Run("roofline/models", "roofline: each model's eager step (bf16, fused Adam, compute "
            "only) against its floor", "benchmarks/roofline.py", ("--budget", "90"), 100,
            kind="report"),
    ],
    "cl": [
        Run("cl/repro", "compiled channels-last U-Net levels, torch alone",
            "benchmarks/cl_compile_repro.py", ("--timeout", "90", "--eager-timeout", "45"),
            110, kind="report"),
    ],
    "fp8": [
        Run("fp8/mp", "linears in fp8 (tensorwise) against bf16 at the mp ViT's size, compiled",
            "benchmarks/fp8_linears.py", ("--budget", "90"), 110, kind="report"),
    ],
}
# The one device call (its estimate in --dry-run): series, or runs by key.
PLAN = ("roofline", "cl/repro", "fp8", "unet/short_opt", "vit/short_opt", "vit/short_opt_again")
RUNS = {run.key: run for runs in SERIES.values() for run in runs}


def select(names) -> list[Run]:
    """The runs of ``names`` (series or run keys), in that order, each once."""
    return list(dict.fromkeys(run for name in names for run in SERIES.get(name) or [RUNS[name]]))


def run_timeout(est_s: float) -> float:
    """A run's default timeout: twice its estimate and 30 s more (starts vary)."""
    return 2 * est_s + 30


# The tutorials' A100-40GB figures, samples/s, as our rows compute theirs: the median of the
# epochs after the first of the runs their READMEs print (in /work/shared/reference/seeds).
# U-Net: SC22 "Deep Learning at Scale" README (seeds/000), config short, batch 64, 3 epochs.
# ViT: SC23 README (seeds/001), config short, batch 16, 4 epochs.
TUTORIAL = {
    "unet/short_opt": (519.2, "SC22's fastest single-GPU run, DALI + AMP + APEX + JIT "
                              "(TorchScript): 496.45, 542.01"),
    "vit/short_opt": (42.84, "SC23, DALI + AMP bf16 + fused Adam + torch.compile: "
                             "42.74, 42.85, 42.84 (DL4SCI25, 8 workers, fp16: 41.67)"),
}

# ---------------------------------------------------------------------------- reading logs
# What train.py prints (log_epoch, log_memory; engine/throughput_report.py),
# after logging_utils' "<time> - INFO - " prefix.
_NUM = r"[\d.]+(?:e[+-]\d+)?"
_EPOCH = re.compile(r"Epoch (\d+): ([\d.]+) s for \d+ steps, ([\d.]+) samples/s")
_WAIT = re.compile(r"Waited for data (\d+)% of the epoch(?: \([^)]*\))?"
                   r"(?:; steady state \(after step 1\) ([\d.]+) samples/s)?")
_TFLOPS = re.compile(rf"Model ({_NUM}) TFLOP/s per device \(({_NUM}) GFLOP per sample\)"
                     rf"(?:, MFU ([\d.]+)% of ({_NUM}) TFLOP/s)?")
_START = re.compile(r"Start: ([\d.]+) s to the end of the first step(?:.|\n)*?first step ([\d.]+) s")
_CACHES = re.compile(r"compile caches .*: (\d+) hits, (\d+) misses")
_PEAK = re.compile(r"Memory after forward pass \(Gi?B, per rank\): [^;]*; "
                   r"peak: ([\d.]+(?:, [\d.]+)*)")
_THROUGHPUT = re.compile(r"Throughput \([^)]*\): IO ([\d.]+) \+/- [\d.]+, SYNTHETIC ([\d.]+) "
                         r"\+/- [\d.]+, FULL ([\d.]+) \+/- [\d.]+")
_BOTTLENECK = re.compile(r"Bottleneck: (.*)$", re.MULTILINE)
_ERROR = re.compile(r"^(?:\[rank \d+\] )?error: ")  # the entry scripts' one-line errors
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\w*: \S")  # a traceback's


def read_log(text: str) -> dict:
    """A run's numbers from its log: the rates and the data-wait share are medians over the
    epochs after the first (or the only one), TFLOP/s and MFU the last epoch's, the peak memory
    the largest over ranks and epochs (GiB)."""
    rates, seconds, waits, steady = [], [], [], []
    for line in text.splitlines():
        if m := _EPOCH.search(line):
            seconds.append(float(m.group(2)))
            rates.append(float(m.group(3)))
            waits.append(None)
            steady.append(None)
        elif (m := _WAIT.search(line)) and rates and waits[-1] is None:
            waits[-1] = float(m.group(1))
            steady[-1] = float(m.group(2)) if m.group(2) else None
    if not rates:
        raise ValueError("no epoch line in the log")

    def median_after_first(values):
        kept = [v for v in (values[1:] or values) if v is not None]
        return statistics.median(kept) if kept else None
    flops = _TFLOPS.findall(text)
    peaks = [float(v) for line in _PEAK.findall(text) for v in line.split(", ")]
    report = _THROUGHPUT.search(text)
    bottleneck = _BOTTLENECK.search(text.split("Throughput (")[-1]) if report else None
    start = _START.search(text)
    caches = _CACHES.search(text)
    return {
        "samples_per_s": median_after_first(rates),
        "epochs": rates,
        "epoch_s": seconds,
        "start_s": float(start.group(1)) if start else None,
        "first_step_s": float(start.group(2)) if start else None,
        "cache_hits": (int(caches.group(1)), int(caches.group(2))) if caches else None,
        "wait_pct": median_after_first(waits),
        "steady_per_s": median_after_first(steady),
        "tflops": float(flops[-1][0]) if flops else None,
        "gflop_per_sample": float(flops[-1][1]) if flops else None,
        "mfu": float(flops[-1][2]) if flops and flops[-1][2] else None,
        "peak_tflops": float(flops[-1][3]) if flops and flops[-1][3] else None,
        "peak_gb": max(peaks) if peaks else None,
        "throughput": dict(zip(("IO", "SYNTHETIC", "FULL"), map(float, report.groups())))
        if report else None,
        "bottleneck": bottleneck.group(1).strip() if bottleneck else None,
    }


def last_error_line(text: str) -> str:
    """The line that says why a run failed: the entry scripts' ``error: ...`` line, else a
    traceback's exception line (torchrun's empty ChildFailedError summary skipped), else the
    last line printed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pattern in (_ERROR, _EXCEPTION):
        found = [ln for ln in lines if pattern.match(ln)]
        if found:
            return found[-1]
    return lines[-1] if lines else "(no output)"


def run_logged(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """(exit code, or None when it ran past ``timeout`` seconds; stdout and stderr together).
    The run gets its own process group, killed whole when it ends, times out or is interrupted
    (Ctrl-C reaches only this script's group): loader workers or compile workers left behind
    would keep the GPU and the output pipe."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as p:
        try:
            out = p.communicate(timeout=timeout)[0]
            code = p.returncode
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        if code is None:  # the output it wrote before it was killed
            out = p.communicate()[0]
    return code, out


def outcome(code: int | None, output: str, timeout: float, report: str | None = None) -> dict:
    """A training run's ``read_log`` numbers when it succeeded; a report run's ``{"report": the
    JSON it wrote at ``report``}`` when that has its ``markdown`` (whatever the exit code: a
    verdict such as "does not compile" is a result); else ``{"failed": why}``: the exit code (or
    signal) or the timeout, and the last error line."""
    if report is not None:
        try:
            with open(report) as f:
                written = json.load(f)
        except (OSError, ValueError):
            written = None
        if isinstance(written, dict) and written.get("markdown"):
            return {"report": written}
    if code is None:
        return {"failed": f"timed out after {timeout:g} s; last line: {last_error_line(output)}"}
    if report is not None:
        return {"failed": f"exit {code}, no result written: {last_error_line(output)}"}
    if code != 0:
        how = f"exit {code}" if code > 0 else f"killed by signal {-code}"  # e.g. 9: out of memory
        return {"failed": f"{how}: {last_error_line(output)}"}
    try:
        return read_log(output)
    except ValueError as e:
        return {"failed": f"exit 0 but {e}; last line: {last_error_line(output)}"}


# ---------------------------------------------------------------------------- the budget

class Budget:
    """Seconds left of a call's ``total``; a run's timeout, or None (skip it) when too little is
    left for it."""

    def __init__(self, total: float, clock=time.monotonic):
        self.total, self.clock, self.t0 = total, clock, clock()

    def left(self) -> float:
        return self.total - (self.clock() - self.t0)

    def timeout(self, est_s: float, cap: float) -> float | None:
        left = self.left()
        if left < max(MIN_RUN_S, 0.5 * est_s):
            return None
        return min(cap, left)

    def skipped(self, est_s: float) -> dict:
        return {"skipped": f"not run: {max(0.0, self.left()):.0f} s left of the {self.total:g} s "
                           f"--budget, about {est_s:.0f} s needed"}


# ---------------------------------------------------------------------------- the table

def why_not(r: dict) -> str | None:
    """Why a run has no figures (it failed or was skipped), None when it ran."""
    return ("failed: " + r["failed"]) if "failed" in r else r.get("skipped")


def _fmt(v, spec, unit=""):
    return format(v, spec) + unit if v is not None else "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def notes(r: dict) -> str:
    out = []
    if r.get("start_s") is not None:
        out.append(f"start {r['start_s']:.0f} s (first step {r['first_step_s']:.0f} s)")
    if r.get("epoch_s"):
        out.append(f"first epoch {r['epoch_s'][0]:.1f} s")
    if r.get("cache_hits"):
        out.append(f"compile caches {r['cache_hits'][0]} hits, {r['cache_hits'][1]} misses")
    if r.get("throughput"):
        t = r["throughput"]
        out.append(f"FULL/SYNTHETIC {t['FULL'] / t['SYNTHETIC']:.2f}")
    if r.get("report"):
        out.append("its section below")
    return "; ".join(out)


COLUMNS = ("series", "run", "samples/s", "vs prev", "vs first", "data wait", "TFLOP/s", "MFU",
           "peak GiB", "A100 (tutorial)", "ours / A100", "notes")


def table(rows: list[tuple[Run, dict]]) -> str:
    """Markdown, one line per run. Speed-ups are against the row before in its series and the
    series' first row (training rows alone, none when either has no figure); a failed or
    skipped run's line says so and why."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * 9 + "---|"]
    first, prev = {}, {}
    for run, r in rows:
        rate = r.get("samples_per_s") if run.kind == "train" else None
        base = first.setdefault(run.series, rate)
        before = prev.get(run.series)
        prev[run.series] = rate
        if why := why_not(r):
            out.append(f"| {run.series} | {_cell(run.label)} | {_cell(why[:300])} |"
                       + " - |" * 9)
            continue
        tutorial = TUTORIAL.get(run.key, (None, ""))[0]
        cells = [run.series, _cell(run.label), _fmt(r.get("samples_per_s"), ".1f"),
                 _fmt(rate / before if rate and before else None, ".2f", "x"),
                 _fmt(rate / base if rate and base else None, ".2f", "x"),
                 _fmt(r.get("wait_pct"), ".0f", "%"), _fmt(r.get("tflops"), ".3g"),
                 _fmt(r.get("mfu"), ".1f", "%"), _fmt(r.get("peak_gb"), ".2f"),
                 _fmt(tutorial, ".1f"),
                 _fmt(r["samples_per_s"] / tutorial if tutorial and r.get("samples_per_s")
                      else None, ".2f", "x"),
                 _cell(notes(r))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def throughput_table(rows: list[tuple[Run, dict]]) -> str:
    out = ["| run | IO | SYNTHETIC | FULL | FULL / SYNTHETIC | bottleneck |",
           "|---|---:|---:|---:|---:|---|"]
    for run, r in rows:
        if r.get("throughput"):
            t = r["throughput"]
            out.append(f"| {run.series}: {_cell(run.label)} | {t['IO']:.1f} | "
                       f"{t['SYNTHETIC']:.1f} | {t['FULL']:.1f} | "
                       f"{t['FULL'] / t['SYNTHETIC']:.2f} | {_cell(r.get('bottleneck') or '')} |")
    return "\n".join(out) if len(out) > 2 else ""


def _ratio(r, goal):
    t = r.get("throughput")
    if not t:
        return None
    x = t["FULL"] / t["SYNTHETIC"]
    return (f"FULL {t['FULL']:.1f} / SYNTHETIC {t['SYNTHETIC']:.1f} = {x:.2f}", x >= goal)


def _rate(r, goal):
    x = r.get("samples_per_s")
    return (f"{x:.1f} samples/s", x >= goal) if x is not None else None


def _synthetic_mfu(r, goal):
    """MFU of the throughput report's SYNTHETIC rate (the step alone, compute only)."""
    t, gflop, peak = r.get("throughput"), r.get("gflop_per_sample"), r.get("peak_tflops")
    if not t or not gflop or not peak:
        return None
    mfu = 100 * t["SYNTHETIC"] * gflop / 1e3 / peak
    return f"SYNTHETIC {t['SYNTHETIC']:.1f} samples/s x {gflop:g} GFLOP = MFU {mfu:.1f}%", \
        mfu >= goal


def _first_epoch(r):
    """A run's first epoch: at most twice the median of the others plus 5 s."""
    seconds = r.get("epoch_s") or []
    if len(seconds) < 2:
        return None
    steady = statistics.median(seconds[1:])
    limit = 2 * steady + 5
    start = f"; start {r['start_s']:.0f} s, first step {r['first_step_s']:.0f} s" \
        if r.get("start_s") is not None else ""
    hits = f"; compile caches {r['cache_hits'][0]} hits, {r['cache_hits'][1]} misses" \
        if r.get("cache_hits") else ""
    return (f"first epoch {seconds[0]:.1f} s, steady {steady:.2f} s: limit {limit:.1f} s"
            f"{start}{hits}", seconds[0] <= limit)


def _report(by, key):
    return by.get(key, {}).get("report") or {}


def _against_roofline(by, goal):
    """The U-Net's short_opt rate against the rate of the roofline's step (the sum of its
    layers' floors, at the device's rates measured in the same call, at the same batch)."""
    rate = by.get("unet/short_opt", {}).get("samples_per_s")
    unet = next((m for m in _report(by, "roofline/models").get("models", [])
                 if m.get("model") == "unet" and m.get("roofline_ms")), None)
    if not rate or unet is None:
        return None
    floor_rate = unet["batch"] * 1e3 / unet["roofline_ms"]
    return (f"{rate:.1f} samples/s; the roofline's step {unet['roofline_ms']:.1f} ms for "
            f"{unet['batch']}: {floor_rate:.0f} samples/s; {rate / floor_rate:.2f} of it",
            rate / floor_rate >= goal)


def _compiles(by):
    report = _report(by, "cl/repro")
    if not report.get("lines"):
        return None
    return report["lines"][-1], bool(report.get("works"))


def _fp8(by, goal):
    rows = [r for r in _report(by, "fp8/mp").get("rows", [])
            if r.get("recipe") not in (None, "none") and "speedup" in r]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["speedup"])
    return (f"fp8 {best['recipe']}: {best['ms']:.1f} ms/step, {best['speedup']:.3f}x bf16",
            best["speedup"] >= goal)


# (goal, the rows it reads: all must be in the plan, how it is measured from their results)
GOALS = [
    ("U-Net short_opt, device loader: >= 2500 samples/s", ("unet/short_opt",),
     lambda by: _rate(by.get("unet/short_opt", {}), 2500)),
    ("U-Net, device loader: FULL >= 0.9 SYNTHETIC", ("unet/short_opt",),
     lambda by: _ratio(by.get("unet/short_opt", {}), 0.9)),
    ("U-Net short_opt, device loader: >= 0.8 of the roofline's rate", ("unet/short_opt",
                                                                        "roofline/models"),
     lambda by: _against_roofline(by, 0.8)),
    ("ViT compute only (short_opt's SYNTHETIC) >= 30% MFU (bf16)", ("vit/short_opt",),
     lambda by: _synthetic_mfu(by.get("vit/short_opt", {}), 30.0)),
    ("ViT compute only (short_opt's SYNTHETIC) >= 35% MFU (bf16; the moonshot)",
     ("vit/short_opt",), lambda by: _synthetic_mfu(by.get("vit/short_opt", {}), 35.0)),
    ("ViT, 8 workers (short_opt): FULL >= 0.9 SYNTHETIC", ("vit/short_opt",),
     lambda by: _ratio(by.get("vit/short_opt", {}), 0.9)),
    ("ViT, a second run: first epoch <= 2 x steady + 5 s", ("vit/short_opt_again",),
     lambda by: _first_epoch(by.get("vit/short_opt_again", {}))),
    ("Compiled channels-last (torch alone): eager's numbers within its limit", ("cl/repro",),
     _compiles),
    ("fp8 linears, mp ViT, compiled: >= 1.15x bf16", ("fp8/mp",), lambda by: _fp8(by, 1.15)),
]


def goals(rows: list[tuple[Run, dict]]) -> list[tuple[str, str, str]]:
    """(goal, measured, "reached" / "not reached" / "not measured") for each goal whose rows
    this call ran."""
    by = {run.key: r for run, r in rows}
    out = []
    for text, needs, measure in GOALS:
        if not all(k in by for k in needs):
            continue
        got = measure(by)
        if got is None:
            why = next((by[k].get("failed") or by[k].get("skipped") for k in needs
                        if "failed" in by[k] or "skipped" in by[k]), "no figure in its log")
            out.append((text, f"- ({why[:120]})", "not measured"))
        else:
            out.append((text, got[0], "reached" if got[1] else "not reached"))
    return out


def document(header: list[str], rows: list[tuple[Run, dict]]) -> str:
    parts = ["# GPU runs", "\n".join(header), "## Runs", table(rows)]
    for run, r in rows:
        if r.get("report"):
            parts += [f"## {run.label[0].upper()}{run.label[1:]}", r["report"]["markdown"]]
    through = throughput_table(rows)
    if through:
        parts += ["## Data path (--throughput_report, samples/s)", through]
    reached = goals(rows)
    if reached:
        parts += ["## Goals", "| goal | measured | result |\n|---|---|---|\n" + "\n".join(
            f"| {_cell(g)} | {_cell(m)} | {v} |" for g, m, v in reached)]
    cited = [(k, v, src) for k, (v, src) in TUTORIAL.items() if k in {run.key for run, _ in rows}]
    if cited:
        parts += ["## The tutorials' A100-40GB figures (median of the epochs after the first)",
                  "\n".join(f"- {k}: {v:g} samples/s; {src}" for k, v, src in cited)]
    return "\n\n".join(parts) + "\n"


def versions() -> str:
    """The GPU's name and the software's versions (main has checked that there is a GPU)."""
    import torch

    line = f"{torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn:
        line += f", cuDNN {cudnn}"
    line += f"; {os.cpu_count()} CPU cores"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True)
    except OSError:  # no nvidia-smi on the PATH: the line goes without the driver
        return line
    if smi.returncode == 0:
        line += f"; driver {smi.stdout.strip()}"
    return line


def nothing_ran(rows: list[tuple[Run, dict]], timeout: float | None) -> str:
    """The ``error:`` line when no run succeeded, naming what to change."""
    failed = [(run, r) for run, r in rows if "failed" in r]
    if failed and all(r["failed"].startswith("timed out") for _, r in failed):
        limit = f" after {timeout:g} s" if timeout else ""
        return (f"error: all {len(failed)} runs timed out{limit}: raise --timeout (or check the "
                f"data under --data); nothing written")
    if not failed:
        return (f"error: none of the {len(rows)} runs ran within --budget: raise it or run "
                f"fewer series (--only); nothing written")
    run, r = next((run, r) for run, r in failed if not r["failed"].startswith("timed out"))
    return (f"error: none of the {len(rows)} runs succeeded; the first failure, [{run.series}] "
            f"{run.label}: {r['failed']}: fix that (its command is printed above) and run "
            f"again; nothing written")


# ---------------------------------------------------------------------------- running

def command(run: Run, data_dir: str, expdir: str) -> list[str]:
    """The command line of ``run``."""
    if run.kind == "report":
        return [sys.executable, run.script, *run.args, "--json", os.path.join(expdir, "report.json")]
    data = ["--data_root", os.path.join(data_dir, run.data)] if run.data else []
    return [sys.executable, run.script, *run.args, *data, "--expdir", expdir, "--run_num", "0"]


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it: ``python`` for this interpreter, paths under the
    repository relative to it."""
    def short(a):
        if a == sys.executable:
            return "python"
        if os.path.isabs(a) and a.startswith(ROOT + os.sep):
            return os.path.relpath(a, ROOT)
        return a
    return shlex.join(short(a) for a in cmd)


def data_kinds(runs: list[Run]) -> list[str]:
    return [k for k in gpu_data.KINDS if any(run.data == k for run in runs)]


def dry_run(runs: list[Run], a, data_dir: str, budget: float):
    kinds = data_kinds(runs)
    total = 0.0
    if kinds:
        make = gpu_data.estimate_s(kinds, a.cosmo, a.era5_steps)
        total += make
        how = "make data" if a.make_data else "data needed (--make-data writes it first)"
        sizes = {"cosmo": f"cosmology boxes of sides {a.cosmo[0]} and {a.cosmo[1]}",
                 "era5": f"ERA5 files of {a.era5_steps[0]} and {a.era5_steps[1]} steps of "
                         f"{gpu_data.ERA5_SIZE[0]} x {gpu_data.ERA5_SIZE[1]}"}
        print(f"{how}, est {make:.0f} s: {'; '.join(sizes[k] for k in kinds)} under {data_dir}")
    for i, run in enumerate(runs):
        expdir = os.path.join(tempfile.gettempdir(), "gpu_runs-XXXX", f"run{i}")
        cap = a.timeout or run_timeout(run.est_s)
        print(f"[{run.series}] {run.label}: est {run.est_s:.0f} s, timeout {cap:.0f} s")
        print(f"    {shown(command(run, data_dir, expdir))}")
        total += run.est_s
    over = "" if total <= budget else ": more than one call's, split it with --only"
    print(f"estimated: {total:.0f} s for a {budget:g} s --budget{over} (on an H200, from its "
          f"earlier runs' figures)")


class Writer:
    """The out dir's files, rewritten after every run: the table, the runs' log, the JSON."""

    def __init__(self, out_dir: str, header: list[str]):
        os.makedirs(out_dir, exist_ok=True)
        self.header = header
        self.table = unused_path(os.path.join(out_dir, "GPU.md"))
        self.log = unused_path(os.path.join(out_dir, "gpu_runs.log"))
        self.json = unused_path(os.path.join(out_dir, "gpu_runs.json"))
        self.wrote_table = False

    def log_run(self, run: Run, cmd: list[str], code, seconds: float, output: str,
                cap: int = 400_000):
        if len(output) > cap:  # the start and the end: the file must come back (16 MiB at most)
            output = output[: cap // 10] + "\n[... cut ...]\n" + output[-(cap - cap // 10):]
        with open(self.log, "a") as f:
            f.write(f"==== [{run.series}] {run.label}\n$ {shown(cmd)}\n"
                    f"(exit {code}, {seconds:.1f} s)\n{output}\n")

    def rows(self, rows: list[tuple[Run, dict]]):
        if not any("failed" not in r and "skipped" not in r for _, r in rows):
            return  # nothing succeeded yet: nothing written
        with open(self.table, "w") as f:
            f.write(document(self.header, rows))
        with open(self.json, "w") as f:
            json.dump({"header": self.header, "rows": [
                {"key": run.key, "label": run.label, **r} for run, r in rows]}, f, indent=1)
        self.wrote_table = True


def execute(run: Run, i: int, a, data_dir: str, tmp: str, env: dict, budget: Budget,
            writer: Writer) -> dict:
    """Run one row and return its result."""
    timeout = budget.timeout(run.est_s, a.timeout or run_timeout(run.est_s))
    if timeout is None:
        return budget.skipped(run.est_s)
    expdir = os.path.join(tmp, f"run{i}")
    cmd = command(run, data_dir, expdir)
    print(f"[{run.series}] {run.label}: {shown(cmd)}", flush=True)
    t0 = time.monotonic()
    os.makedirs(expdir, exist_ok=True)
    code, output = run_logged(cmd, env, timeout)
    writer.log_run(run, cmd, code, time.monotonic() - t0, output)
    report = os.path.join(expdir, "report.json") if run.kind == "report" else None
    result = outcome(code, output, timeout, report)
    result["seconds"] = round(time.monotonic() - t0, 1)
    shutil.rmtree(expdir, ignore_errors=True)  # checkpoints of a 117 M-parameter model: 1.4 GB
    return result


def _terminated(signum, frame):
    raise SystemExit("error: terminated (SIGTERM); the rows measured so far are written")


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.gpu_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(SERIES) + list(RUNS),
                   help="run these series only, in this order (default: all)")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "gpu_bench"),
                   help="directory of the data (cosmo/, era5/)")
    p.add_argument("--make-data", action="store_true",
                   help="write the data the chosen series read under --data first (kept when "
                        "already there)")
    p.add_argument("--cosmo", type=at_least(2), nargs=2, default=list(gpu_data.COSMO_SIDES),
                   metavar=("TRAIN", "VALID"), help="cosmology box sides (default: %(default)s)")
    p.add_argument("--era5-steps", type=at_least(2), nargs=2, default=list(gpu_data.ERA5_STEPS),
                   metavar=("TRAIN", "VALID"),
                   help="steps of the ERA5 files, 360 x 720 (default: %(default)s)")
    p.add_argument("--out-dir", default=None,
                   help="where the table (GPU.md) and the runs' log go (default: $OUT "
                        "when set, else benchmarks/)")
    p.add_argument("--timeout", type=at_least(1.0, float), default=None,
                   help="seconds each run may take before it is killed and marked failed "
                        "(default: twice its estimate and 30 s)")
    p.add_argument("--budget", type=at_least(1.0, float), default=BUDGET_S,
                   help="seconds for the whole call; runs that would not fit are skipped rows "
                        "(default: %(default)g)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands and their estimates, run nothing")
    a = p.parse_args(argv)
    runs = select(a.only or PLAN)
    data_dir = os.path.abspath(a.data)
    out_dir = a.out_dir or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks")
    if a.dry_run:
        dry_run(runs, a, data_dir, a.budget)
        return
    import torch

    if not torch.cuda.is_available():
        refuse("no CUDA GPU here: run this on a GPU node (--dry-run prints the commands)")
    budget = Budget(a.budget)
    kinds = data_kinds(runs)
    made = ""
    if kinds and a.make_data:
        try:
            made = f"data made in {gpu_data.make(data_dir, kinds, a.cosmo, a.era5_steps):.1f} s"
        except ValueError as e:  # another data set's files in the way: nothing written
            refuse(str(e))
    missing = [k for k in kinds if not (
        gpu_data.has_cosmo(data_dir, a.cosmo) if k == "cosmo"
        else gpu_data.has_era5(data_dir, a.era5_steps, gpu_data.ERA5_SIZE))]
    if missing:
        sys.exit(f"error: no {' or '.join(missing)} data of the planned sizes under {data_dir}: "
                 f"add --make-data (it writes them in seconds) or point --data at them")
    header = [versions(), f"`python -m benchmarks.gpu_runs {shlex.join(argv or sys.argv[1:])}`"
              f" under a {a.budget:g} s budget" + (f"; {made}" if made else "")]
    writer = Writer(out_dir, header)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rows = []
    # A SIGTERM (a job's or a device command's time limit) unwinds like Ctrl-C: the run in
    # flight, in a process session of its own, is killed with its group on the way out.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_runs-") as tmp:
            for i, run in enumerate(runs):
                result = execute(run, i, a, data_dir, tmp, env, budget, writer)
                rows.append((run, result))
                rate = result.get("samples_per_s")
                figures = (f"{rate:.1f} samples/s; " if rate is not None else "") + notes(result)
                print(f"    {why_not(result) or figures}", flush=True)
                writer.rows(rows)
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [run for run, r in rows if "failed" in r]
    skipped = [run for run, r in rows if "skipped" in r]
    if not writer.wrote_table:
        sys.exit(nothing_ran(rows, a.timeout))
    print(f"written: {writer.table}, {writer.log}, {writer.json}")
    if failed or skipped:
        again = sorted({run.series for run in skipped})
        print(f"error: {len(failed)} of {len(rows)} runs failed, {len(skipped)} skipped (rows "
              f"marked in {writer.table})" + (f"; run the skipped ones again with --only "
                                              f"{' '.join(again)}" if again else ""),
              file=sys.stderr, flush=True)
    print("\n" + document(header, rows), flush=True)  # the table, last
    if failed or skipped:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
