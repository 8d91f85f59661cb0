"""Data-parallel scaling of the training step on this machine: weak and strong scaling series.

    python -m benchmarks.scaling                    # both models, 1/2/4 ranks, ~7 min on 2 cores
    python -m benchmarks.scaling --models vit --ranks 1,2
    python -m benchmarks.scaling --plot-only        # redraw from benchmarks/scaling/results.json

Every point is one ``torchrun`` of a model's ``quickstart``, with DDP and with --noddp; the
method and the results: benchmarks/scaling/RESULTS.md. Run it on a quiet machine: other
processes' load would be timed as ours. Writes results.json, prints Markdown tables, and with
matplotlib (pip install -r requirements-plots.txt) draws throughput.png and efficiency.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from settings.errors import OneLineParser, at_least, counts, refuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "scaling")

# Per model: YAML, overrides making a step long enough to time, weak local batch, strong global
# batch, steps per epoch.
MODELS = {
    "vit": dict(label="ViT quickstart (embed 128, depth 4, 32x64 fields, patch 4)",
                yaml="config/ViT.yaml", weak_local=8, strong_global=16, steps=10,
                args=["--synthetic_steps_per_year", "240"],
                nsamples="--limit_nsamples", nsamples_val=("--limit_nsamples_val", "8")),
    "unet": dict(label="U-Net quickstart (width 8-64, 5 levels, 32^3 crops)",
                 yaml="config/UNet.yaml", weak_local=8, strong_global=16, steps=16,
                 args=["--data_size", "32"],
                 nsamples="--Nsamples", nsamples_val=("--Nsamples_val", "8")),
}
EPOCHS = 5
EPOCH = re.compile(r"Epoch (\d+): ([0-9.]+) s for \d+ steps, ([0-9.]+) samples/s")


def run_point(model: str, ranks: int, local_batch: int, noddp: bool, work: str, log_dir: str):
    """One torchrun; returns samples/s (median of epochs 2..) and the per-epoch numbers."""
    m = MODELS[model]
    tag = f"{model}_n{ranks}_b{local_batch}{'_noddp' if noddp else ''}_{time.time_ns()}"
    n_train = local_batch * ranks * m["steps"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), os.path.join(ROOT, "train.py"),
           "--yaml_config", os.path.join(ROOT, m["yaml"]), "--config", "quickstart",
           "--data_loader_config", "synthetic", "--num_data_workers", "0",
           "--local_batch_size", str(local_batch), "--num_epochs", str(EPOCHS),
           "--log_every", str(m["steps"]), "--checkpoint_every", "0",
           "--expdir", os.path.join(work, "runs"),
           "--run_num", tag, m["nsamples"], str(n_train), *m["nsamples_val"], *m["args"]]
    if noddp:
        cmd.append("--noddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    load = os.getloadavg()[0]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    with open(os.path.join(log_dir, tag + ".log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{tag} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    epochs = [dict(epoch=int(e), seconds=float(s), samples_per_s=float(t))
              for e, s, t in EPOCH.findall(r.stdout)]
    if not any(e["epoch"] >= 2 for e in epochs):
        raise RuntimeError(f"{tag}: no 'Epoch N: ... samples/s' lines after epoch 1 in its log")
    return dict(model=model, ranks=ranks, local_batch=local_batch, global_batch=local_batch * ranks,
                noddp=noddp, **summarise(epochs), epochs=epochs, wall_s=round(wall, 1),
                load_before=round(load, 2))


def summarise(epochs):
    """Median (the reported value) and best samples/s over the epochs after each run's first."""
    rates = [e["samples_per_s"] for e in epochs if e["epoch"] >= 2]
    return dict(samples_per_s=statistics.median(rates), best_samples_per_s=max(rates))


def plan(models, ranks):
    """(model, ranks, local batch, noddp) for every point; shared points run once."""
    points = []
    for model in models:
        m = MODELS[model]
        for n in ranks:
            for noddp in ((False, True) if n > 1 else (False,)):  # 1 rank: nothing to all-reduce
                points.append((model, n, m["weak_local"], noddp))
                if m["strong_global"] % n == 0:
                    points.append((model, n, m["strong_global"] // n, noddp))
    return list(dict.fromkeys(points))


def series(results, model, kind, noddp):
    """[(ranks, samples/s)] of one series; the 1-rank point is shared by DDP and noddp."""
    m = MODELS[model]
    out = []
    for r in sorted(results, key=lambda r: r["ranks"]):
        if r["model"] != model or (r["noddp"] != noddp and r["ranks"] > 1):
            continue
        if (r["local_batch"] == m["weak_local"] if kind == "weak"
                else r["global_batch"] == m["strong_global"]):
            out.append((r["ranks"], r["samples_per_s"]))
    return out


def tables(results, cores) -> str:
    lines = []
    for model in MODELS:
        if not any(r["model"] == model for r in results):
            continue
        m = MODELS[model]
        for kind in ("weak", "strong"):
            batch = (f"local batch {m['weak_local']} per rank" if kind == "weak"
                     else f"global batch {m['strong_global']}")
            lines += [f"**{model}, {kind} scaling** ({batch}); samples/s, efficiency vs "
                      f"N x 1 rank", "",
                      "| ranks | global batch | DDP samples/s | DDP efficiency | noddp samples/s "
                      "| noddp efficiency | all-reduce share |",
                      "|---:|---:|---:|---:|---:|---:|---:|"]
            ddp, nod = dict(series(results, model, kind, False)), dict(series(results, model, kind, True))
            base = ddp.get(1)
            for n in sorted(ddp):
                g = m["weak_local"] * n if kind == "weak" else m["strong_global"]
                eff = f"{ddp[n] / (n * base):.0%}" if base else "-"
                ne = f"{nod[n] / (n * base):.0%}" if base and n in nod else "-"
                ns = f"{nod[n]:.1f}" if n in nod else "-"
                share = 1 - ddp[n] / nod[n] if n in nod and n > 1 else None
                comm = "-" if share is None else f"{share:.0%}" if abs(share) >= 0.005 else "0%"
                over = " (oversubscribed)" if n > cores else ""
                lines.append(f"| {n}{over} | {g} | {ddp[n]:.1f} | {eff} | {ns} | {ne} | {comm} |")
            lines.append("")
    return "\n".join(lines)


def plot(results, cores, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -r requirements-plots.txt)")
        return []
    models = [m for m in MODELS if any(r["model"] == m for r in results)]
    files = []
    for what in ("throughput", "efficiency"):
        fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
        for i, model in enumerate(models):
            for j, kind in enumerate(("weak", "strong")):
                ax = axes[i][j]
                ddp, nod = series(results, model, kind, False), series(results, model, kind, True)
                if not ddp:
                    continue
                base = dict(ddp).get(1)
                ns = [n for n, _ in ddp]

                def scaled(v, n):  # samples/s, or the efficiency against N x 1 rank
                    return v if what == "throughput" else v / (n * base)
                for data, style, name in ((ddp, "o-", "DDP"), (nod, "s--", "noddp (no gradient "
                                                                           "all-reduce)")):
                    if not data:
                        continue
                    ax.plot([n for n, _ in data], [scaled(v, n) for n, v in data], style, label=name)
                if base:
                    ax.plot(ns, [scaled(n * base, n) for n in ns], ":", color="grey",
                            label="ideal (N x 1 rank)")
                    ax.plot(ns, [scaled(min(n, cores) * base, n) for n in ns], "-.",
                            color="tab:red", alpha=0.6, label=f"ideal on {cores} cores")
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.set(xlabel="ranks (gloo, CPU)",
                       ylabel="samples/s" if what == "throughput" else "scaling efficiency")
                if what == "efficiency":
                    ax.set_ylim(0, 1.1)
                ax.set_title(f"{model}: {kind} scaling", fontsize=10)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"Data-parallel {what}, {cores}-core CPU VM, cached batch (I/O excluded)",
                     fontsize=11)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{what}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def run_series(args, work):
    """Every point of the plan, --repeats times; returns the document results.json holds."""
    log_dir = os.path.join(work, "logs")  # every run's full log
    os.makedirs(log_dir, exist_ok=True)
    pooled, t0 = {}, time.time()
    todo = plan(args.models.split(","), args.ranks)
    for rep in range(args.repeats):
        # every other round in reverse order, so slow drifts of the machine even out
        for i, point in enumerate(todo if rep % 2 == 0 else todo[::-1]):
            model, n, b, noddp = point
            r = run_point(*point, work, log_dir)
            if point in pooled:  # pool the epochs of every round
                before = pooled[point]
                r["epochs"] = before["epochs"] + r["epochs"]
                r["load_before"] = max(r["load_before"], before["load_before"])
                r["wall_s"] = round(r["wall_s"] + before["wall_s"], 1)
                r.update(summarise(r["epochs"]))
            pooled[point] = r
            print(f"[{rep + 1}.{i + 1}/{len(todo)}] {model} ranks={n} local={b} global={b * n}"
                  f"{' noddp' if noddp else ''}: {r['samples_per_s']:.1f} samples/s "
                  f"(run {r['wall_s']} s)", flush=True)
    import torch

    return dict(machine=dict(cores=os.cpu_count() or 1, platform=platform.platform(),
                             python=platform.python_version(), torch=torch.__version__,
                             backend="gloo", threads_per_rank=1),
                repeats=args.repeats, epochs_per_run=EPOCHS,
                date=time.strftime("%Y-%m-%d %H:%M"), total_s=round(time.time() - t0),
                results=[pooled[p] for p in todo])


def read_results(path):
    """The results and core count of an earlier series; refused naming the file and the fix."""
    fix = "run 'python -m benchmarks.scaling' first, or give --out the directory that holds it"
    try:
        with open(path) as f:
            doc = json.load(f)
        return doc["results"], doc["machine"]["cores"]
    except FileNotFoundError:
        refuse(f"--plot-only: no results in {path}: {fix}")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        refuse(f"--plot-only: {path} is not a results file of this script "
               f"({type(e).__name__}: {e}): {fix}")


def model_names(text: str) -> str:
    """An argparse ``type``: models of MODELS, comma-separated (kept as the text)."""
    unknown = [m for m in text.split(",") if m not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: no model {unknown[0]!r}: choose from "
                                         f"{', '.join(MODELS)}, comma-separated")
    return text


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n")[0])
    p.add_argument("--models", type=model_names, default="vit,unet",
                   help="models to measure, comma-separated")
    p.add_argument("--ranks", type=counts(1, "1,2,4", " ranks"), default="1,2,4",
                   help="rank counts of each series, comma-separated")
    p.add_argument("--out", default=OUT, help="directory of results.json and the plots "
                   "(default: %(default)s)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="run the whole series this many times, pooling each point's epochs")
    p.add_argument("--plot-only", action="store_true",
                   help="only redraw the plots and tables from --out's results.json")
    args = p.parse_args(argv)
    results_path = os.path.join(args.out, "results.json")
    cores = os.cpu_count() or 1
    if args.plot_only:
        results, cores = read_results(results_path)
    else:
        os.makedirs(args.out, exist_ok=True)
        work = args.work or tempfile.mkdtemp(prefix="scaling-")
        try:
            doc = run_series(args, work)
        finally:
            if not args.work:  # the runs' checkpoints and logs; kept with --work
                shutil.rmtree(work, ignore_errors=True)
        with open(results_path, "w") as f:
            json.dump(doc, f, indent=1)
        results = doc["results"]
    print(tables(results, cores))
    for path in plot(results, cores, args.out):
        print("wrote", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    main()
