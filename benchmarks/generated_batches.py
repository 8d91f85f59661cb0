"""Start-up cost of ``--data_loader_config synthetic``: seconds to make a rank's batches in memory.

    python -m benchmarks.generated_batches                      # ViT short, U-Net short, ViT mp
    python -m benchmarks.generated_batches --configs ViT:short --rounds 3

For each config: the time ``build_loaders`` takes on one rank holding the whole global batch (the
training batch, the validation batch and, for ERA5, the normalisation statistics, which the task
asks for at the first step), on the CPU, best of ``--rounds`` fresh processes' worth of work
(the caches of ``datapipe.generated_data`` are cleared between rounds). Prints a Markdown table.
"""
from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datapipe import generated_data  # noqa: E402
from settings.config import ViTConfig  # noqa: E402
from settings.errors import ConfigError, OneLineParser, at_least, refuse  # noqa: E402
from settings.parse import build_config, load_yaml_configs  # noqa: E402
from datapipe.data_loader import build_loaders  # noqa: E402

DEFAULT = ["ViT:short", "UNet:short", "ViT:mp"]
YAMLS = ("ViT", "UNet")  # config/<YAML>.yaml


def config_pair(item: str) -> tuple[str, str]:
    """``YAML:CONFIG`` as (yaml name, config name), the config built with synthetic data;
    refused in one line naming the valid pairs."""
    valid = [f"{y}:{c}" for y in YAMLS
             for c in load_yaml_configs(os.path.join(ROOT, "config", f"{y}.yaml"))]
    yaml_name, sep, name = item.partition(":")
    if not sep or yaml_name not in YAMLS or f"{yaml_name}:{name}" not in valid:
        refuse(f"--configs {item}: not a YAML:CONFIG pair of config/ViT.yaml or "
               f"config/UNet.yaml: choose from {', '.join(valid)}")
    try:
        build_config(os.path.join(ROOT, "config", f"{yaml_name}.yaml"), name,
                     dict(data_loader_config="synthetic"))
    except ConfigError as e:
        refuse(f"--configs {item}: {e}")
    return yaml_name, name


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
    p = OneLineParser(prog="python -m benchmarks.generated_batches",
                      description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT,
                   help="YAML:CONFIG pairs to time (default: %(default)s)")
    p.add_argument("--rounds", type=at_least(1), default=1,
                   help="rounds per config; the best is kept (default: %(default)s)")
    args = p.parse_args(argv)
    pairs = [config_pair(item) for item in args.configs]  # all checked before any is timed
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| config | training batch | seconds |\n|---|---|---|")
    for yaml_name, name in pairs:
        best, shape = min(seconds(yaml_name, name) for _ in range(args.rounds))
        print(f"| {yaml_name} {name} | {shape} | {best:.3f} |", flush=True)


if __name__ == "__main__":
    main()
