"""The tutorial's single-GPU sequence and the other GPU fast paths, run and tabulated for
benchmarks/GPU.md.

    python -m benchmarks.gpu_runs                   # on a GPU node: every run, ~20 min on an H100
    python -m benchmarks.gpu_runs --only unet       # one series
    python -m benchmarks.gpu_runs --dry-run         # print the commands, run nothing

Series (each run a short training of real size on synthetic data made first under --data):

- ``unet``: the U-Net ``short`` config through the tutorial's steps, each adding one switch:
  baseline -> 8 loader workers -> AMP (bf16) -> fused Adam -> torch.compile -> CUDA graphs
  (``train_graph.py``, which replaces torch.compile);
- ``vit``: the ViT ``short`` config with bf16 + fused Adam, then + torch.compile (MFU);
- ``dist``: NCCL data parallel on one rank (torchrun) and ``train_mp.py`` with tp=1.

For every run the table has samples/s (median of the epochs after the first), speed-up over the
series' first run, TFLOP/s and MFU (from the epoch lines), and the peak memory the allocator
reported. The result goes to ``--out`` (benchmarks/GPU.md) with the device, torch, CUDA and
driver versions; an existing file is kept and the new table written beside it (``GPU_2.md``...).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from utils.profiling import unused_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNET = ["--yaml_config", "config/UNet.yaml", "--config", "short", "--num_epochs", "3"]
VIT = ["--config", "short", "--num_iters", "96"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]

# series -> [(label, script or launcher + script, arguments)]
SERIES = {
    "unet": [
        ("baseline", ["train.py"], UNET),
        ("+ 8 loader workers", ["train.py"], UNET + ["--num_data_workers", "8"]),
        ("+ AMP bf16", ["train.py"], UNET + ["--num_data_workers", "8", "--amp_mode", "bf16"]),
        ("+ fused Adam", ["train.py"], UNET + ["--num_data_workers", "8", "--amp_mode", "bf16",
                                               "--enable_fused"]),
        ("+ torch.compile", ["train.py"], UNET + ["--num_data_workers", "8", "--amp_mode",
                                                  "bf16", "--enable_fused", "--enable_jit"]),
        ("CUDA graphs instead of compile", ["train_graph.py"],
         UNET + ["--num_data_workers", "8", "--amp_mode", "bf16", "--enable_fused"]),
        ("fp16 + scaler, fused, graphs", ["train_graph.py"],
         UNET + ["--num_data_workers", "8", "--amp_mode", "fp16"]),
    ],
    "vit": [
        ("bf16, fused Adam", ["train.py"], VIT + ["--num_data_workers", "8", "--amp_mode", "bf16",
                                                  "--enable_fused"]),
        ("+ torch.compile", ["train.py"], VIT + ["--num_data_workers", "8", "--amp_mode", "bf16",
                                                 "--enable_fused", "--enable_jit"]),
    ],
    "dist": [
        ("DDP over NCCL, 1 rank", TORCHRUN + ["train.py"], UNET + ["--num_data_workers", "8",
                                                                    "--amp_mode", "bf16"]),
        ("train_mp.py, tp=1", TORCHRUN + ["train_mp.py"],
         VIT + ["--amp_mode", "bf16", "--tensor_parallel", "1"]),
    ],
}

_EPOCH = re.compile(r"Epoch (\d+): [\d.]+ s for \d+ steps, ([\d.]+) samples/s")
_TFLOPS = re.compile(r"Model ([\d.e+-]+) TFLOP/s per device.*?(?:MFU ([\d.]+)%)?$", re.M)
_PEAK = re.compile(r"peak: ([\d.]+)")
_GRAPH = re.compile(r"CUDA graph: step ([\d.]+) ms replayed, ([\d.]+) ms eager.*?: ([\d.]+)x")


def read_log(text: str) -> dict:
    """Samples/s (median over the epochs after the first, or the only one), TFLOP/s and MFU of
    the last epoch, peak memory (GB, max over ranks and epochs) and the CUDA-graph line."""
    rates = [float(r) for _, r in _EPOCH.findall(text)]
    if not rates:
        raise ValueError("no epoch line in the log")
    flops = _TFLOPS.findall(text)
    peaks = [float(v) for line in _PEAK.findall(text) for v in line.split(",")]
    graph = _GRAPH.search(text)
    return {
        "samples_per_s": statistics.median(rates[1:] or rates),
        "tflops": float(flops[-1][0]) if flops else None,
        "mfu": float(flops[-1][1]) if flops and flops[-1][1] else None,
        "peak_gb": max(peaks) if peaks else None,
        "graph": graph.group(0) if graph else None,
    }


def table(rows: list[tuple[str, str, dict]]) -> str:
    """Markdown: one line per run, speed-up against the first run of its series."""
    out = ["| series | run | samples/s | speed-up | TFLOP/s | MFU | peak GB |",
           "|---|---|---:|---:|---:|---:|---:|"]
    first = {}
    for series, label, r in rows:
        base = first.setdefault(series, r["samples_per_s"])

        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        out.append(f"| {series} | {label} | {r['samples_per_s']:.1f} | "
                   f"{r['samples_per_s'] / base:.2f}x | {fmt(r['tflops'], '.3g')} | "
                   f"{fmt(r['mfu'], '.1f')}{'%' if r['mfu'] is not None else ''} | "
                   f"{fmt(r['peak_gb'], '.2f')} |")
    return "\n".join(out)


def versions() -> str:
    import torch

    line = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if torch.cuda.is_available():
        line = f"{torch.cuda.get_device_name()}; " + line
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        if smi.returncode == 0:
            line += f", driver {smi.stdout.strip()}"
    return line


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(SERIES), help="run these series only")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "gpu_bench"),
                   help="directory of the synthetic data (made when missing)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "GPU.md"),
                   help="Markdown file of the table (a new name when it exists)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = p.parse_args(argv)
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
        r = subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"    failed (exit {r.returncode}): {r.stderr.strip()[-500:]}", flush=True)
            continue
        result = read_log(r.stdout + r.stderr)
        rows.append((s, label, result))
        print(f"    {result['samples_per_s']:.1f} samples/s" +
              (f"; {result['graph']}" if result["graph"] else ""), flush=True)
    out = unused_path(a.out)
    with open(out, "w") as f:
        f.write(f"# GPU runs\n\n{versions()}\n\n{table(rows)}\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
