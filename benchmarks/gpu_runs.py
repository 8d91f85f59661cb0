"""The tutorial's single-GPU sequence and the other GPU fast paths, run and tabulated for
benchmarks/GPU.md.

    python -m benchmarks.gpu_runs                   # on a GPU node: every run, ~20 min on an H100
    python -m benchmarks.gpu_runs --only unet       # one series
    python -m benchmarks.gpu_runs --timeout 900     # allow each run 900 s (default 600)
    python -m benchmarks.gpu_runs --dry-run         # print the commands, run nothing

Series (each run a short training of real size on synthetic data made first under --data):

- ``unet``: the U-Net ``short`` config through the tutorial's steps, each adding one switch:
  baseline -> 8 loader workers -> AMP (bf16) -> fused Adam -> torch.compile -> CUDA graphs
  (``train_graph.py``, which replaces torch.compile);
- ``vit``: the ViT ``short`` config with bf16 + fused Adam, then + torch.compile (MFU), then
  the first run's settings through ``train_mp.py`` (tp=1) started by torchrun on one rank.

One rank means WORLD_SIZE=1, which makes no process group: that last row measures train_mp.py's
entry and the launcher, neither DDP nor NCCL, and its label says so. DDP and NCCL are measured
only with ``--nproc_per_node`` > 1, on a node with that many GPUs.

For every run the table has samples/s (median of the epochs after the first), speed-up over the
series' first run, TFLOP/s and MFU (from the epoch lines), and the peak memory the allocator
reported (the largest over ranks and epochs). A run that exits non-zero, runs past ``--timeout``
(it is killed with its child processes) or logs no epoch is a row saying ``failed`` and why,
with its last error line. The table goes to ``--out`` (benchmarks/GPU.md) with the device,
torch, CUDA and driver versions; an existing file is kept and the new table written beside it
(``GPU_2.md``...). When no run succeeds nothing is written and the exit status is 1; when some
fail the table is written and the exit status is 1 too.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

from utils.profiling import unused_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNET = ["--yaml_config", "config/UNet.yaml", "--config", "short", "--num_epochs", "3"]
VIT = ["--config", "short", "--num_iters", "96"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
FAST = ["--num_data_workers", "8", "--amp_mode", "bf16", "--enable_fused"]

# series -> [(label, script or launcher + script, arguments)]; speed-ups are against the
# series' first run, so a series holds one model and a row changes one thing.
SERIES = {
    "unet": [
        ("baseline", ["train.py"], UNET),
        ("+ 8 loader workers", ["train.py"], UNET + ["--num_data_workers", "8"]),
        ("+ AMP bf16", ["train.py"], UNET + ["--num_data_workers", "8", "--amp_mode", "bf16"]),
        ("+ fused Adam", ["train.py"], UNET + FAST),
        ("+ torch.compile", ["train.py"], UNET + FAST + ["--enable_jit"]),
        ("CUDA graphs instead of compile", ["train_graph.py"], UNET + FAST),
        ("fp16 + scaler, fused, graphs", ["train_graph.py"],
         UNET + ["--num_data_workers", "8", "--amp_mode", "fp16"]),
    ],
    "vit": [
        ("bf16, fused Adam", ["train.py"], VIT + FAST),
        ("+ torch.compile", ["train.py"], VIT + FAST + ["--enable_jit"]),
        ("train_mp.py tp=1 via torchrun, 1 rank (no process group)", TORCHRUN + ["train_mp.py"],
         VIT + FAST + ["--tensor_parallel", "1"]),
    ],
}

# What train.py prints (log_epoch, log_memory) after logging_utils' "<time> - INFO - " prefix.
_EPOCH = re.compile(r"Epoch (\d+): [\d.]+ s for \d+ steps, ([\d.]+) samples/s")
_TFLOPS = re.compile(r"Model ([\d.]+(?:e[+-]\d+)?) TFLOP/s per device"
                     r" \([^)]*GFLOP per sample\)(?:, MFU ([\d.]+)% of)?")
_PEAK = re.compile(r"Memory after forward pass \(GB, per rank\): [^;]*; peak: ([\d.]+(?:, [\d.]+)*)")
_GRAPH = re.compile(r"CUDA graph: step ([\d.]+) ms replayed, ([\d.]+) ms eager.*?: ([\d.]+)x")
_ERROR = re.compile(r"^(?:\[rank \d+\] )?error: ")  # the entry scripts' one-line errors
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\w*: \S")  # a traceback's


def read_log(text: str) -> dict:
    """Samples/s (median over the epochs after the first, or the only one), TFLOP/s and MFU of
    the last epoch, peak memory (GB, max over ranks and epochs) and the CUDA-graph line."""
    rates = [float(r) for _, r in _EPOCH.findall(text)]
    if not rates:
        raise ValueError("no epoch line in the log")
    flops = _TFLOPS.findall(text)
    peaks = [float(v) for line in _PEAK.findall(text) for v in line.split(", ")]
    graph = _GRAPH.search(text)
    return {
        "samples_per_s": statistics.median(rates[1:] or rates),
        "tflops": float(flops[-1][0]) if flops else None,
        "mfu": float(flops[-1][1]) if flops and flops[-1][1] else None,
        "peak_gb": max(peaks) if peaks else None,
        "graph": graph.group(0) if graph else None,
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
    (Ctrl-C reaches only this script's group): torchrun's ranks and loader workers left behind
    would keep the GPU and the output pipe."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as p:
        try:
            out = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            return None, p.communicate()[0]
        finally:
            _kill_group(p.pid)
    return p.returncode, out


def _kill_group(pid: int):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def outcome(code: int | None, output: str, timeout: float) -> dict:
    """``read_log``'s numbers of a run that succeeded, else ``{"failed": why}``: the exit code
    (or signal) or the timeout, and the last error line."""
    if code is None:
        return {"failed": f"timed out after {timeout:g} s; last line: {last_error_line(output)}"}
    if code != 0:
        how = f"exit {code}" if code > 0 else f"killed by signal {-code}"  # e.g. 9: out of memory
        return {"failed": f"{how}: {last_error_line(output)}"}
    try:
        return read_log(output)
    except ValueError as e:
        return {"failed": f"exit 0 but {e}; last line: {last_error_line(output)}"}


def table(rows: list[tuple[str, str, dict]]) -> str:
    """Markdown: one line per run, speed-up against the first run of its series (none when
    either failed); a failed run's line says ``failed`` and why."""
    out = ["| series | run | samples/s | speed-up | TFLOP/s | MFU | peak GB |",
           "|---|---|---:|---:|---:|---:|---:|"]
    first = {}

    def fmt(v, spec, unit=""):
        return format(v, spec) + unit if v is not None else "-"
    for series, label, r in rows:
        base = first.setdefault(series, r)
        if "failed" in r:
            why = r["failed"][:300].replace("|", "\\|")
            out.append(f"| {series} | {label} | failed: {why} | - | - | - | - |")
            continue
        speedup = None if "failed" in base else r["samples_per_s"] / base["samples_per_s"]
        out.append(f"| {series} | {label} | {r['samples_per_s']:.1f} | {fmt(speedup, '.2f', 'x')} | "
                   f"{fmt(r['tflops'], '.3g')} | {fmt(r['mfu'], '.1f', '%')} | "
                   f"{fmt(r['peak_gb'], '.2f')} |")
    return "\n".join(out)


def versions() -> str:
    import torch

    line = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if torch.cuda.is_available():
        line = f"{torch.cuda.get_device_name()}; " + line
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True)
        except OSError:  # no nvidia-smi on the PATH: the line goes without the driver
            return line
        if smi.returncode == 0:
            line += f", driver {smi.stdout.strip()}"
    return line


def nothing_ran(rows: list[tuple[str, str, dict]], timeout: float) -> str:
    """The ``error:`` line when no run succeeded, naming what to change."""
    if all(r["failed"].startswith("timed out") for _, _, r in rows):
        return (f"error: all {len(rows)} runs timed out after {timeout:g} s: raise --timeout "
                f"(or check the data under --data); nothing written")
    series, label, r = next((s, lb, r) for s, lb, r in rows
                            if not r["failed"].startswith("timed out"))
    return (f"error: none of the {len(rows)} runs succeeded; the first failure, [{series}] "
            f"{label}: {r['failed']}: fix that (its command is printed above) and run again; "
            f"nothing written")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(SERIES), help="run these series only")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "gpu_bench"),
                   help="directory of the synthetic data (made when missing)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "GPU.md"),
                   help="Markdown file of the table (a new name when it exists)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds each run may take before it is killed and marked failed")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = p.parse_args(argv)
    if a.timeout <= 0:
        p.error("--timeout must be a positive number of seconds")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               ERA5_DATA_ROOT=os.path.join(a.data, "era5"),
               COSMO_DATA_ROOT=os.path.join(a.data, "cosmo"))
    runs = [(s, label, cmd, args) for s in (a.only or SERIES) for label, cmd, args in SERIES[s]]
    if a.dry_run:
        for s, label, cmd, args in runs:
            print(f"[{s}] {label}: {' '.join(cmd + args)}")
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here: run this on a GPU node (--dry-run prints the commands)")
    expdir = tempfile.mkdtemp(prefix="gpu_runs-")
    rows = []
    for i, (s, label, cmd, args) in enumerate(runs):
        full = ([sys.executable] if cmd[0].endswith(".py") else []) + cmd + args + [
            "--synthesize_if_missing", "true", "--expdir", expdir, "--run_num", str(i)]
        print(f"[{s}] {label}: {' '.join(full)}", flush=True)
        result = outcome(*run_logged(full, env, a.timeout), a.timeout)
        rows.append((s, label, result))
        if "failed" in result:
            print(f"    failed: {result['failed']}", flush=True)
        else:
            print(f"    {result['samples_per_s']:.1f} samples/s" +
                  (f"; {result['graph']}" if result["graph"] else ""), flush=True)
    failed = sum("failed" in r for _, _, r in rows)
    if failed == len(rows):
        sys.exit(nothing_ran(rows, a.timeout))
    out = unused_path(a.out)
    with open(out, "w") as f:
        f.write(f"# GPU runs\n\n{versions()}\n\n{table(rows)}\n")
    print(f"written: {out}")
    if failed:
        sys.exit(f"error: {failed} of {len(rows)} runs failed (rows marked failed in {out}): "
                 f"see their lines above")


if __name__ == "__main__":
    main()
