"""fp8 linear layers (``--fp8_linears``) against bf16 at the ``mp`` ViT's size, on one GPU:
compute-only training steps, both compiled, in one process, timed in alternating rounds.

    python -m benchmarks.fp8_linears                         # bf16 and fp8 tensorwise, ~4 min
    python -m benchmarks.fp8_linears --recipes tensorwise rowwise --budget 540
    python -m benchmarks.fp8_linears --small                 # a toy ViT on a CPU, emulated

The steps, the rounds, the table and what this script measured before: docs/performance.md
("fp8 linear layers"). A GPU without fp8 or without torchao is refused in one line (exit 2).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from elsewhere
    sys.path.insert(0, ROOT)

from settings.errors import ConfigError, OneLineParser, at_least, new_file, refuse  # noqa: E402

BAR = 1.15  # the speed-up over bf16 at which fp8 stays on by default for the mp config
SMALL = {"img_size": [16, 32], "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 4}


def build_variant(recipe: str, overrides: dict, batch: int, device, compiled: bool) -> dict:
    """One variant's step (a closure over its model, optimizer and batch) and its first step's
    seconds. ``recipe``: ``none`` (bf16) or an fp8 recipe."""
    import torch

    from benchmarks.roofline import compute_only_step
    from engine import fp8_linears
    from engine.optimizer import build_optimizer
    from settings.parse import build_config
    from tasks import make_task
    t0 = time.perf_counter()
    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "mp",
                       {**overrides, "amp_mode": "bf16", "fp8_linears": recipe})
    task = make_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    if recipe != "none":
        fp8_linears.convert(task.blocks(model), recipe, device)
    model = model.to(device)
    optimizer = build_optimizer(model.parameters(), 1e-4, cfg.adam_betas, True, device)
    step_model = torch.compile(model) if compiled else model
    kernels = task.forward_kernels(device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, cfg.n_in_channels, *cfg.img_size, device=device, generator=gen)
    y = torch.randn(batch, cfg.n_out_channels, *cfg.img_size, device=device, generator=gen)

    step = compute_only_step(task, step_model, optimizer, x, y, torch.bfloat16, kernels)
    loss = step().item()  # a host sync: the first step (and compile) is over
    first_s = time.perf_counter() - t0
    for _ in range(2):
        step()
    return dict(recipe=recipe, step=step, first_s=first_s, first_loss=loss,
                flops=task.flops_per_sample(), parameters=sum(p.numel() for p in model.parameters()))


def measure(recipes: list[str], batch: int, steps: int, budget: float, small: bool,
            compiled: bool, max_rounds: int = 10) -> dict:
    """bf16 and each fp8 recipe: built, then timed in alternating rounds (see the module)."""
    import torch

    from benchmarks.roofline import time_calls
    from engine import fp8_linears
    device = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    if device.type == "cpu" and not small:
        refuse("no CUDA GPU here: the mp ViT's steps need one; --small runs a toy ViT on the CPU "
               "in torchao's emulation")
    for recipe in recipes:
        fp8_linears.check(recipe, device)  # ConfigError: no torchao, no fp8 on this GPU
    t_end = time.monotonic() + budget
    built = []
    for recipe in ["none", *recipes]:
        v = build_variant(recipe, dict(SMALL) if small else {}, batch, device, compiled)
        print(f"{label(recipe)}: first step after {v['first_s']:.1f} s, loss {v['first_loss']:.4f}",
              flush=True)
        built.append(v)
    times = {v["recipe"]: [] for v in built}
    rounds = 0
    while rounds < 2 or (rounds < max_rounds and time.monotonic() < t_end):
        for v in built:  # one round: ``steps`` steps of each variant in turn
            times[v["recipe"]].append(time_calls(v["step"], rounds=1, calls=steps, device=device))
        rounds += 1
    base = statistics.median(times["none"])
    rows = []
    for v in built:
        ms = statistics.median(times[v["recipe"]])
        rate = batch * 1000 / ms
        rows.append({"recipe": v["recipe"], "ms": ms, "samples_per_s": rate,
                     "tflops": v["flops"] * rate / 1e12, "speedup": base / ms,
                     "first_step_s": v["first_s"], "rounds": rounds,
                     "parameters": v["parameters"]})
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "batch": batch, "compiled": compiled, "rows": rows}


def label(recipe: str) -> str:
    return "bf16" if recipe == "none" else f"fp8 {recipe}"


def table(out: dict) -> str:
    mode = "torch.compile" if out["compiled"] else "eager"
    lines = [f"{out['device']}, torch {out['torch']}, batch {out['batch']}, bf16 autocast, fused "
             f"Adam, {mode}, compute only",
             "| linears | ms/step | samples/s | model TFLOP/s | x bf16 | first step s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {label(r['recipe'])} | {r['ms']:.1f} | {r['samples_per_s']:.2f} | "
                     f"{r['tflops']:.1f} | {r['speedup']:.3f} | {r['first_step_s']:.1f} |")
    best = max(out["rows"][1:], key=lambda r: r["speedup"])  # the fastest fp8 variant
    verdict = "reaches" if best["speedup"] >= BAR else "does not reach"
    lines.append(f"fastest fp8: {label(best['recipe'])}, {best['speedup']:.3f}x bf16 "
                 f"({best['rounds']} rounds): {verdict} the {BAR}x bar")
    return "\n".join(lines)


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.fp8_linears", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", choices=["tensorwise", "rowwise"],
                   default=["tensorwise"], help="fp8 variants timed against bf16 "
                   "(default: %(default)s)")
    p.add_argument("--batch", type=at_least(1), default=None,
                   help="samples per step (default: 8; 2 with --small)")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help="steps per variant per round (default: 10; 2 with --small)")
    p.add_argument("--rounds", type=at_least(2), default=10,
                   help="timed rounds at most (at least 2 are run) (default: %(default)s)")
    p.add_argument("--budget", type=at_least(1.0, float), default=240.0,
                   help="seconds for building and timing; rounds stop (at least 2) "
                        "(default: %(default)g)")
    p.add_argument("--small", action="store_true",
                   help="a toy ViT on the CPU in torchao's emulation, for the tests")
    p.add_argument("--json", type=new_file, default="",
                   help="also write the rows to this JSON file (a new file)")
    a = p.parse_args(argv)
    batch = a.batch or (2 if a.small else 8)
    steps = a.steps or (2 if a.small else 10)
    try:
        out = measure(a.recipes, batch, steps, a.budget, a.small,
                      compiled=not a.small, max_rounds=a.rounds)
    except ConfigError as e:
        refuse(str(e))
    out["markdown"] = table(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(out["markdown"])


if __name__ == "__main__":
    main()
