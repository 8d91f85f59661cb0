"""The start of a run with loader workers: the first training pass begun before the model is
built (this tree) against begun at the first epoch's first fetch (as before), on one machine,
alternating, each run a fresh process.

    python -m benchmarks.first_batch                      # ViT, 2 workers, compiled, 3 pairs
    python -m benchmarks.first_batch --workers 8 --pairs 5 --no-compile

Both runs are ``train.py``'s ``run()`` on the same data and settings; "at first fetch" replaces
``Loaders.begin_training_pass`` by one that only sets the sampler's epoch, so its first pass
begins where the first epoch asks for its first batch. With ``--enable_jit`` (the default here)
a warm-up run fills a compile cache of its own first, so the runs measure a second run's start
(torch.compile's graphs from the cache). Per run, from its log: seconds from the process's
start to the end of the first step (the ``Start:`` line), its ``model`` and ``first batch``
parts, and the first epoch's wall time. The table (medians over the pairs) is printed last.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DRIVER = """
import sys
sys.path.insert(0, {root!r})
import train
from datapipe.data_loader import Loaders
from settings.cli import from_argv

if sys.argv[1] == "first-fetch":
    Loaders.begin_training_pass = lambda self, epoch, first=0: \\
        self.train_sampler.set_epoch(epoch, first)
train.run(from_argv(sys.argv[2:]))
"""

START = re.compile(r"Start: ([\d.]+) s to the end of the first step")
PART = re.compile(r"(model|first batch) ([\d.]+) s")
EPOCH = re.compile(r"Epoch 1: ([\d.]+) s for")


def run(driver: str, variant: str, args: list[str]) -> dict:
    r = subprocess.run([sys.executable, driver, variant, *args], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if r.returncode:
        raise SystemExit(f"error: the {variant} run failed (exit {r.returncode}): "
                         f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    start = START.search(r.stdout)
    parts = dict(PART.findall("\n".join(r.stdout[start.start():].splitlines()[:3])))
    return {"start": float(start.group(1)), "model": float(parts["model"]),
            "first batch": float(parts["first batch"]),
            "first epoch": float(EPOCH.search(r.stdout).group(1))}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="loader workers (default 2)")
    p.add_argument("--pairs", type=int, default=3, help="runs of each variant (default 3)")
    p.add_argument("--img_size", default="[360,720]", help="ERA5 image size (default [360,720])")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="without --enable_jit (the model part is then short)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="first_batch-") as tmp:
        driver = os.path.join(tmp, "driver.py")
        with open(driver, "w") as f:
            f.write(DRIVER.format(root=ROOT))
        args = ["--config", "quickstart", "--img_size", a.img_size, "--patch_size", "8",
                "--embed_dim", "64", "--depth", "2", "--num_heads", "2",
                "--global_batch_size", "8", "--num_iters", "4", "--limit_nsamples", "32",
                "--limit_nsamples_val", "8", "--num_data_workers", str(a.workers),
                "--data_root", os.path.join(tmp, "era5"), "--checkpoint_every", "0"]
        if a.compile:
            args += ["--enable_jit", "--compile_cache_dir", os.path.join(tmp, "cache")]
        variants = ("first-fetch", "before-model")
        print("warm-up run (data, compile cache) ...", flush=True)
        run(driver, "before-model", args + ["--expdir", os.path.join(tmp, "warm")])
        got = {v: [] for v in variants}
        for i in range(a.pairs):
            for v in variants:
                got[v].append(run(driver, v, args + ["--expdir", os.path.join(tmp, f"{v}{i}")]))
                print(f"pair {i + 1}, {v}: " + ", ".join(f"{k} {x:.2f} s"
                                                        for k, x in got[v][-1].items()),
                      flush=True)
    keys = list(got[variants[0]][0])
    med = {v: {k: statistics.median(r[k] for r in got[v]) for k in keys} for v in variants}
    print(f"\nViT {a.img_size}, {a.workers} loader workers, "
          f"{'compiled (warm cache)' if a.compile else 'eager'}; median of {a.pairs} runs each "
          f"(seconds)")
    print(f"| first pass begun | {' | '.join(keys)} |")
    print("|---|" + "---:|" * len(keys))
    for v, name in zip(variants, ("at the first fetch (before)", "before the model (now)")):
        print(f"| {name} | " + " | ".join(f"{med[v][k]:.2f}" for k in keys) + " |")
    print("| before / now | " + " | ".join(
        f"{med[variants[0]][k] / med[variants[1]][k]:.2f}x" if med[variants[1]][k] else "-"
        for k in keys) + " |")


if __name__ == "__main__":
    main()
