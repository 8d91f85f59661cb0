"""How fast score.py scores the ViT: forecast steps per second of a batched 10-day rollout,
beside the forward rate of the same model at the same batch on the same device.

    python -m benchmarks.score_speed                          # the quickstart ViT on the CPU, batch 8
    python -m benchmarks.score_speed --batch 16 --rounds 5
    python -m benchmarks.score_speed --device cuda --amp_mode bf16

Data: synthetic ERA5 years (``datapipe.synthetic``) at the config's ``img_size``, written to a
temporary directory (removed at the end unless ``--data`` names a directory to keep). The model
has random weights (nothing is trained: the speed does not depend on the weights).

Three rates, each in samples (one initial condition advanced one step) per second, over
``--n_init`` x the rollout's steps samples:

* forward: the model's forward pass on a batch of ``--batch`` random inputs, in eval and
  inference mode, under the autocast and attention kernels of scoring: what one rollout step
  costs at best (as many whole batches as fit in those samples, at least one; the rate counts
  the samples they ran);
* rollout: ``tasks.forecast_skill.rollout`` alone, each step's output the next step's input;
* scoring: ``tasks.forecast_skill.score`` whole, as ``score.py`` runs it: the stored states
  read from the year files at every lead time, RMSE and ACC of the three forecasts, the report.

scoring / forward is the share of the forward rate that scoring reaches. Each rate is the best
of ``--rounds`` rounds (interleaved, so that a busy machine affects all three alike).

On the CPU, subnormal floats (below 1.2e-38) are flushed to zero (``torch.set_flush_denormal``)
unless ``--keep_denormals``: without the flush, the forward rate on 2 threads of a 2-core AMD EPYC
depended on the values of the inputs (random normal inputs 2 to 10 times slower than the
model's own, smaller outputs; on 1 thread it did not), so the three rates would not compare. On a GPU
the scoring round runs once more under ``torch.cuda.set_sync_debug_mode``: the synchronising
calls it reports, per rollout step, are the host waits of the rollout.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datapipe import synthetic  # noqa: E402
from engine.runtime import check_amp, choose_device  # noqa: E402
from settings.errors import ConfigError, OneLineParser, at_least, refuse  # noqa: E402
from settings.parse import build_config  # noqa: E402
from engine.runtime import AMP_DTYPES  # noqa: E402
from score import forward_context  # noqa: E402
from tasks import forecast_skill, make_task  # noqa: E402



def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks.score_speed",
                      description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="quickstart",
                   help="config of config/ViT.yaml whose model is timed (default quickstart)")
    p.add_argument("--batch", type=at_least(1), default=8,
                   help="initial conditions per forward pass, score.py's --batch_size (default 8, "
                        "its default)")
    p.add_argument("--n_init", type=at_least(1), default=16,
                   help="initial conditions scored per round (default 16: two batches of 8)")
    p.add_argument("--lead_steps", type=at_least(1), default=None,
                   help="rollout steps (default: 10 days of the model's 6-hour steps, 40 at dt=1)")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="rounds of the three measurements; each rate is the best round (default 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                   help="where the model runs (default cpu; auto: a GPU when there is one)")
    p.add_argument("--amp_mode", choices=tuple(AMP_DTYPES), default="none",
                   help="mixed precision of the forward passes (default none: fp32)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch's intra-op threads on the CPU (default: torch's choice)")
    p.add_argument("--keep_denormals", action="store_true",
                   help="CPU: compute with subnormal floats, as score.py does, instead of flushing "
                        "them to zero (rates then depend on the values)")
    p.add_argument("--data", default=None,
                   help="directory for the synthetic ERA5 years, kept afterwards (default: a "
                        "temporary one, removed)")
    return p


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config(args, data: str):
    """The config whose model is timed, its data in ``data``."""
    return build_config(os.path.join(ROOT, "config", "ViT.yaml"), args.config,
                        {"data_root": data, "synthesize_if_missing": "false",
                         "device": args.device, "amp_mode": args.amp_mode})


def main(argv=None):
    args = parser().parse_args(argv)
    try:  # refused before any data is written
        cfg = config(args, args.data or tempfile.gettempdir())
        check_amp(cfg, choose_device(cfg, 0))
    except ConfigError as e:
        refuse(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    flushed = not args.keep_denormals and torch.set_flush_denormal(True)
    logging.getLogger("score").setLevel(logging.WARNING)  # the scoring's own progress lines
    data = args.data or tempfile.mkdtemp(prefix="score_speed_")
    try:
        run(args, data, flushed)
    finally:
        if args.data is None:
            shutil.rmtree(data, ignore_errors=True)


def run(args, data: str, flushed: bool):
    cfg = config(args, data)
    n_steps = args.lead_steps or forecast_skill.DEFAULT_LEAD_HOURS // (
        forecast_skill.HOURS_PER_STEP * cfg.dt)
    if not os.path.isdir(os.path.join(data, "valid")):
        # one validation year long enough for n_init starts, each followed by its whole rollout
        synthetic.make_era5(data, img_size=cfg.img_size, train_years=(2014,), valid_years=(2016,),
                            test_years=(), steps_per_year=n_steps * cfg.dt + args.n_init + 1)
    device = choose_device(cfg, 0)
    check_amp(cfg, device)
    torch.manual_seed(0)
    task = make_task(cfg)
    model = task.build_model().to(device).eval()
    autocast = forward_context(task, device, cfg.amp_mode)  # as score.py runs it

    def step(state):
        with autocast():
            return model(state).float()

    samples = args.n_init * n_steps
    batches = [min(args.batch, args.n_init - b) for b in range(0, args.n_init, args.batch)]
    x = torch.randn(args.batch, cfg.n_in_channels, *cfg.img_size, device=device)
    opts = argparse.Namespace(split="valid", lead_steps=n_steps, n_init=args.n_init,
                              batch_size=args.batch)

    # the whole batches that fit in the samples, at least one: its rate counts the samples run
    passes = max(1, samples // args.batch)
    run_samples = {"forward": passes * args.batch, "rollout": samples, "scoring": samples}

    def forward():
        for _ in range(passes):
            step(x)

    def rollout():
        for size in batches:
            for _ in forecast_skill.rollout(step, x[:size], n_steps):
                pass

    def scoring():
        forecast_skill.score(task, model, device, autocast, opts)

    timed = {"forward": forward, "rollout": rollout, "scoring": scoring}
    best = dict.fromkeys(timed, float("inf"))
    with torch.inference_mode():
        step(x)  # warm-up: first-call allocations, kernel choices
        for _ in range(args.rounds):
            for name, fn in timed.items():
                synchronize(device)
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                best[name] = min(best[name], time.perf_counter() - t0)
    syncs = count_syncs(scoring, device)

    params = sum(p.numel() for p in model.parameters())
    cpu = cpu_name()
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
    print(f"ViT {args.config}: {params / 1e6:.2f} M parameters, img_size {cfg.img_size}, "
          f"patch {cfg.patch_size}, amp_mode {cfg.amp_mode}, on {where}"
          f"{', subnormals flushed' if flushed and device.type == 'cpu' else ''}")
    print(f"{args.n_init} initial conditions x {n_steps} steps = {samples} samples per round, "
          f"batch {args.batch}, best of {args.rounds} rounds")
    if run_samples["forward"] != samples:
        print(f"forward: {passes} pass{'es' if passes > 1 else ''} of batch {args.batch} = "
              f"{run_samples['forward']} samples per round (whole batches, at least one)")
    rates = {name: run_samples[name] / best[name] for name in timed}
    print(f"{'':10} {'seconds':>8} {'samples/s':>10} {'of forward':>10}")
    for name in timed:
        print(f"{name:10} {best[name]:8.3f} {rates[name]:10.1f} "
              f"{rates[name] / rates['forward']:10.2f}")
    print(f"host syncs per rollout step while scoring: {syncs}")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what Python knows of it."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def count_syncs(scoring, device: torch.device) -> str:
    """The synchronising CUDA calls of one scoring round, as torch's sync debug mode reports
    them (a GPU only: on the CPU the host runs the ops itself)."""
    if device.type != "cuda":
        return "none to count on the CPU (the host runs every op)"
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            scoring()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return f"{len(found)} in the round" + (f", e.g. {found[0]}" if found else "")


if __name__ == "__main__":
    main()
