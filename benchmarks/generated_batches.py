"""Start-up cost of ``--data_loader_config synthetic``: seconds to make a rank's batches in memory.

    python -m benchmarks.generated_batches                      # ViT short, U-Net short, ViT mp
    python -m benchmarks.generated_batches --configs ViT:short --rounds 3

For each config: the time ``build_loaders`` takes on one rank holding the whole global batch (the
training batch, the validation batch and, for ERA5, the normalisation statistics, which the task
asks for at the first step), on the CPU, best of ``--rounds`` fresh processes' worth of work
(the caches of ``datapipe.generated_data`` are cleared between rounds). Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datapipe import generated_data  # noqa: E402
from settings.config import ViTConfig  # noqa: E402
from settings.parse import build_config  # noqa: E402
from datapipe.data_loader import build_loaders  # noqa: E402

DEFAULT = ["ViT:short", "UNet:short", "ViT:mp"]


def seconds(yaml_name: str, name: str) -> tuple[float, str]:
    cfg = build_config(os.path.join(ROOT, "config", f"{yaml_name}.yaml"), name,
                       dict(data_loader_config="synthetic"))
    generated_data._era5_stats.cache_clear()
    generated_data._cosmo_box.cache_clear()
    t0 = time.perf_counter()
    loaders = build_loaders(cfg, 1, 0, cfg.global_batch_size, torch.device("cpu"))
    if isinstance(cfg, ViTConfig):
        generated_data.era5_stats(cfg)
    elapsed = time.perf_counter() - t0
    x, _ = next(iter(loaders.train))
    return elapsed, " x ".join(map(str, x.shape))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.generated_batches",
                                description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT,
                   help="YAML:CONFIG pairs to time (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="rounds per config; the best is kept "
                   "(default: %(default)s)")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| config | training batch | seconds |\n|---|---|---|")
    for item in args.configs:
        yaml_name, name = item.split(":")
        best, shape = min(seconds(yaml_name, name) for _ in range(args.rounds))
        print(f"| {yaml_name} {name} | {shape} | {best:.3f} |", flush=True)


if __name__ == "__main__":
    main()
