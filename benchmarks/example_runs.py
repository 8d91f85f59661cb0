"""The example runs of ``example_logs/``: real runs of this repository, small enough for a laptop,
that show what the tutorial's chapters discuss, and the picture of their loss curves.

    python -m benchmarks.example_runs --out /tmp/examples     # all runs, ~25 min on 2 cores
    python -m benchmarks.example_runs --out DIR --only large_batch
    python -m benchmarks.example_runs --plot-only --out example_logs   # redraw the picture

Groups (``RUNS``; each a directory of ``--out``, which must not exist or be empty) and what each
shows: example_logs/README.md; what is kept of a run (checkpoints are removed) and the picture
(``loss_curves.png``; needs matplotlib, ``pip install -r requirements-plots.txt``):
docs/example-runs.md.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time

from settings.errors import OneLineParser, refuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

UNET = ["--yaml_config", "config/UNet.yaml", "--config", "quickstart"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

# group -> [(run name, launcher prefix, arguments)]
RUNS = {
    "quickstart": [
        ("ViT", [], ["--run_num", "vit"]),
        ("U-Net", [], UNET + ["--run_num", "unet"]),
    ],
    "large_batch": [
        ("batch 16", [], ["--run_num", "bs16"]),
        ("batch 64, lr_scaling none", [],
         ["--run_num", "bs64_none", "--global_batch_size", "64", "--lr_scaling", "none",
          "--warmup_steps", "5"]),
        ("batch 64, lr_scaling sqrt", [],
         ["--run_num", "bs64_sqrt", "--global_batch_size", "64", "--lr_scaling", "sqrt",
          "--warmup_steps", "5"]),
        ("batch 64, lr_scaling linear", [],
         ["--run_num", "bs64_linear", "--global_batch_size", "64", "--lr_scaling", "linear",
          "--warmup_steps", "5"]),
        ("batch 64, linear, no warm-up", [],
         ["--run_num", "bs64_linear_nowarmup", "--global_batch_size", "64", "--lr_scaling",
          "linear", "--warmup_steps", "0"]),
    ],
    "data_parallel": [
        (f"{n} rank{'s' if n > 1 else ''}", TORCHRUN + [f"--nproc_per_node={n}"],
         ["--num_epochs", "5"]) for n in (1, 2, 4)
    ],
    "model_parallel": [
        ("serial (train.py)", [], ["--config", "mp_cpu", "--num_iters", "60"]),
        ("tensor_parallel 2 (train_mp.py)", TORCHRUN + ["--nproc_per_node=2"],
         ["--config", "mp_cpu", "--num_iters", "60", "--tensor_parallel", "2"]),
    ],
}


def run_group(group: str, out: str):
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name, launcher, args in RUNS[group]:
        script = "train_mp.py" if "--tensor_parallel" in args else "train.py"
        cmd = [*(launcher or [sys.executable]), script, *args, "--expdir", out]
        print(f"[{group}] {name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"error: the run '{name}' failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
        print(f"    {time.time() - t0:.0f} s", flush=True)
    for ckpt in glob.glob(os.path.join(out, "**", "checkpoints"), recursive=True):
        shutil.rmtree(ckpt)


def _val_curve(run_dir):
    """(samples seen, validation loss) at each validation of the run in ``run_dir``."""
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    with open(os.path.join(run_dir, "config.yaml")) as f:
        header = {}
        for line in f:  # "# key: value" lines above the config
            if line.startswith("# ") and ": " in line:
                k, v = line[2:].split(": ", 1)
                header[k] = v.strip()
    batch = int(yaml.safe_load(header.get("global_batch_size", "1")))
    points = acc.Scalars("Loss/valid")
    return [p.step * batch for p in points], [p.value for p in points]


def _runs(group_dir):
    """Run directories under ``group_dir``: those holding a config.yaml."""
    return sorted(os.path.dirname(p) for p in
                  glob.glob(os.path.join(group_dir, "**", "config.yaml"), recursive=True))


def plot(out: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: matplotlib is not installed: pip install -r requirements-plots.txt")
    groups = [g for g in RUNS if _runs(os.path.join(out, g))]
    if not groups:
        refuse(f"--out {out}: no runs there to draw: run python -m benchmarks.example_runs "
               f"--out {out} first")
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for run_dir in _runs(os.path.join(out, group)):
            x, y = _val_curve(run_dir)
            ax.plot(x, y, marker="o", markersize=3, label=os.path.relpath(run_dir, out))
        ax.set(title=group.replace("_", " "), xlabel="samples seen", ylabel="validation loss",
               yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out, "loss_curves.png")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.example_runs",
                      description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the runs (new or empty) and the "
                   "picture")
    p.add_argument("--only", nargs="+", choices=list(RUNS), help="run these groups only")
    p.add_argument("--plot-only", action="store_true", help="only redraw the picture of the runs "
                   "already in --out")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        refuse(f"--out {out} is a file, not a directory: name a new directory")
    if not a.plot_only:
        if os.path.exists(out) and os.listdir(out):
            refuse(f"--out {out} is not empty: name a new directory (runs already there are "
                   f"never written over)")
        for group in a.only or RUNS:
            run_group(group, os.path.join(out, group))
    print(f"picture: {plot(out)}")


if __name__ == "__main__":
    main()
