"""Step time and memory of rollout training (docs/training.md) for N = 1, 2, 4 autoregressive
steps, with and without rollout_checkpointing, on one device.

    python -m benchmarks.rollout                                   # a small ViT on the CPU
    python -m benchmarks.rollout --device cuda --img_size '[360,720]' --embed_dim 384 --depth 12

Each row times ``--steps`` optimizer steps (after ``--warmup``) of the task's training loss, its
backward pass and Adam on one batch of random fields; memory is observe.memory.MemoryProbe's. The
columns and figures: docs/performance.md ("Rollout training"). Settings not named here are
config/ViT.yaml's quickstart's; any config key can be given as for train.py.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from benchmarks.roofline import ROOT, time_calls
from observe.memory import MemoryProbe
from settings.errors import OneLineParser, at_least
from settings.parse import build_config, parse_overrides
from tasks.era5 import ERA5Task

SMALL = dict(img_size="[32,64]", patch_size="4", embed_dim="128", depth="4", num_heads="4",
             global_batch_size="4", num_epochs="1")


def measure(cfg, steps: int, checkpointing: bool, device, timed: int, warmup: int) -> dict:
    """Step time (median seconds) and memory of ``steps`` rollout steps on one batch."""
    cfg = dataclasses.replace(cfg, rollout_steps=steps, rollout_checkpointing=checkpointing)
    task = ERA5Task(cfg)
    torch.manual_seed(0)
    model = task.build_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    b, (h, w), c = cfg.global_batch_size, cfg.img_size, cfg.n_in_channels
    x = torch.randn(b, c, h, w, device=device)
    # one target per sample: today's step; a window of targets otherwise (checkpointing works
    # on windows: a schedule's one-step epochs are checkpointed, a run of one step is not)
    one = steps == 1 and not checkpointing
    y = torch.randn((b, c, h, w) if one else (b, steps, c, h, w), device=device)
    probe = MemoryProbe(device, model, optimizer)

    def step():
        with probe.step():
            loss = task.training_loss(model, x, y, task.loss, epoch=0).mean()
            probe.forward_done()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step()
    seconds = time_calls(step, rounds=timed, calls=1, device=device) / 1e3
    return dict(steps=steps, checkpointing=checkpointing, step_s=seconds,
                after_forward=probe.after_forward, peak=probe.peak)


def rollout_list(text: str) -> list[int]:
    steps = [int(n) for n in text.split(",")]  # (a ValueError: argparse's one line)
    if min(steps) < 1:
        raise ValueError(text)
    return steps


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=at_least(1), default=5, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps before them")
    p.add_argument("--rollouts", type=rollout_list, default="1,2,4",
                   help="the rollout steps N, comma-separated")
    args, rest = p.parse_known_args(argv)
    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                       SMALL | parse_overrides(rest)[1])
    device = torch.device(args.device)
    print(f"ViT img_size {cfg.img_size}, patch {cfg.patch_size}, embed {cfg.embed_dim}, depth "
          f"{cfg.depth}, batch {cfg.global_batch_size}, {cfg.n_in_channels} channels on "
          f"{device.type} ({torch.get_num_threads()} threads); memory in MiB "
          f"({MemoryProbe(device, None, None).method()})")
    print(f"{'N':>3} {'checkpointing':>13} {'step (s)':>9} {'x N=1':>6} {'after fwd':>10} "
          f"{'peak':>8} {'x N=1':>6}")
    base = None
    for n in args.rollouts:
        for ckpt in (False, True):
            r = measure(cfg, n, ckpt, device, args.steps, args.warmup)
            base = base or r
            print(f"{n:>3} {'yes' if ckpt else 'no':>13} {r['step_s']:>9.3f} "
                  f"{r['step_s'] / base['step_s']:>6.2f} {r['after_forward'] / 2**20:>10.1f} "
                  f"{r['peak'] / 2**20:>8.1f} {r['peak'] / base['peak']:>6.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
