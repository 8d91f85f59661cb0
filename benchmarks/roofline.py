"""The roofline of each model's training step beside the profiler's measured time, per layer
(U-Net) or op group (ViT). One table per model::

    python -m benchmarks.roofline                      # a GPU: the short configs, bf16 (~1-2 min)
    python -m benchmarks.roofline --small              # the CPU, toy sizes, fp32: seconds
    python -m benchmarks.roofline --budget 120 --json roofline.json

The device's rates, the timed and profiled compute-only steps, each group's floor and how the
measured time is attributed to it: docs/performance.md and benchmarks/roofline.md. ``--json``
writes the rows and the markdown (for ``benchmarks/gpu_runs.py``).
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from settings.errors import OneLineParser, at_least, new_file  # noqa: E402

MODULE_RANGE = "roofline.module:"  # + the module's path below the model ("" for the model)
OPT_RANGE = "roofline.optimizer"
STEP_RANGE = "roofline.step"
WARMUP_RANGE = "roofline.warmup"
EVALUATE = "autograd::engine::evaluate_function: "
YAML = {"vit": "config/ViT.yaml", "unet": "config/UNet.yaml"}
# --small: toy models the CPU steps in tens of milliseconds
SMALL = {"vit": ({"img_size": [32, 64], "patch_size": 4, "embed_dim": 64, "depth": 2,
                  "num_heads": 4}, 4),
         "unet": ({"base_width": 4, "max_width": 16, "full_scale": False, "data_size": 32}, 2)}


def time_calls(fn, rounds: int = 5, calls: int = 10, device=None, best: bool = False) -> float:
    """Median (``best``: least) milliseconds of one call of ``fn`` over ``rounds`` rounds of
    ``calls`` calls (CUDA events on a GPU, the wall clock elsewhere); ``device``: where ``fn``
    runs (default: a GPU when there is one)."""
    import torch
    gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
    times = []
    for _ in range(rounds):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1000 / calls)
    return min(times) if best else statistics.median(times)


def compute_only_step(task, model, optimizer, x, y, dtype, kernels=contextlib.nullcontext,
                      optimizer_range=contextlib.nullcontext):
    """A compute-only training step as the benchmarks time it: the forward of ``model`` on the
    batch ``x`` under autocast to ``dtype`` (float32: none) and ``kernels()``, the task's loss
    (mean) against ``y``, the backward, and ``optimizer``'s step inside ``optimizer_range()``.
    The step returns its loss, not synchronised."""
    import torch

    def step():
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32), \
                kernels():
            loss = task.loss(model(x), y).mean()
        loss.backward()
        with optimizer_range():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


# --------------------------------------------------------------------------- the device's rates

def device_rates(device, small: bool) -> dict:
    """The matmul rate (FLOP/s) of a large GEMM in the step's dtype and the memory bandwidth
    (bytes/s) of a large copy, read + written."""
    import torch
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    n = 8192 if gpu else (512 if small else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)
    mm_ms = time_calls(lambda: torch.mm(a, b, out=c), 5, 10 if gpu else 2, device, best=True)
    numel = 2**28 if gpu else (2**22 if small else 2**25)  # fp32: 1 GiB, 16 MiB, 128 MiB
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = time_calls(lambda: dst.copy_(src), 5, 10 if gpu else 3, device, best=True)
    return {"matmul_flops_per_s": 2 * n**3 / (mm_ms / 1e3),
            "bytes_per_s": 2 * 4 * numel / (copy_ms / 1e3),
            "matmul": f"{str(dtype).split('.')[-1]} {n}^3 GEMM {mm_ms:.3f} ms",
            "copy": f"fp32 copy of {4 * numel / 2**20:.0f} MiB {copy_ms:.3f} ms"}


# ------------------------------------------------------------------------------ one model's step

class ModuleRanges:
    """A record_function range around every module's forward (``MODULE_RANGE`` + its path),
    opened by a forward pre-hook and closed by a forward hook, while the context is open."""

    def __init__(self, model):
        self.model, self.handles, self.open = model, [], {}

    def __enter__(self):
        import torch
        for path, mod in self.model.named_modules():
            def pre(m, args, path=path):
                rf = torch.profiler.record_function(MODULE_RANGE + path)
                rf.__enter__()
                self.open.setdefault(id(m), []).append(rf)

            def post(m, args, out):
                self.open[id(m)].pop().__exit__(None, None, None)
            self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


def build_case(name: str, small: bool, device, memory_format: str = "auto"):
    """The task, model, batch on the device, fused Adam and the step function of one model."""
    import torch

    from engine.optimizer import build_optimizer
    from benchmarks.roofline_model import step_model
    from settings.parse import build_config
    from tasks import make_task
    gpu = device.type == "cuda"
    overrides, batch = SMALL[name] if small else ({}, None)
    if name == "unet":
        overrides = {**overrides, "memory_format": memory_format}
    cfg = build_config(os.path.join(ROOT, YAML[name]), "short",
                       {**overrides, "amp_mode": "bf16" if gpu else "none"})
    batch = batch or cfg.global_batch_size
    task = make_task(cfg)
    # the U-Net in the layout the project takes for this run (eager: channels-last on a GPU)
    fmt = task.memory_format(device)[0] if name == "unet" else torch.contiguous_format
    torch.manual_seed(0)
    model = task.build_model().to(device, memory_format=fmt)
    shape = cfg.img_size if name == "vit" else [cfg.data_size] * 3
    x = torch.randn(batch, cfg.n_in_channels, *shape, device=device)
    y = torch.rand(batch, cfg.n_out_channels, *shape, device=device) * 1.8 - 0.9
    if name == "unet":
        x, y = x.contiguous(memory_format=fmt), y.contiguous(memory_format=fmt)
    opt = build_optimizer(model.parameters(), 1e-4, cfg.adam_betas, True, device)
    dtype = torch.bfloat16 if gpu else torch.float32
    step = compute_only_step(task, model, opt, x, y, dtype, task.forward_kernels(device, dtype),
                             lambda: torch.profiler.record_function(OPT_RANGE))
    layout = "channels_last_3d" if fmt == torch.channels_last_3d else "default layout"
    return model, step, step_model(task, batch, amp=gpu), cfg, layout


def _ancestors(e):
    while e is not None:
        yield e
        e = e.cpu_parent


def attribute(events, step, gpu: bool) -> dict:
    """The profiled time (ms, all steps together) of each of ``step``'s groups, and what stayed
    unattributed, from torch.profiler's events (``prof.events()``): benchmarks/roofline.md,
    "Attributing the measured time"."""
    from benchmarks.roofline_model import CASTS, op_name
    cpu_events = [e for e in events if e.device_type.name == "CPU"
                  and not any(a.name == WARMUP_RANGE for a in _ancestors(e))]
    steps = [e for e in cpu_events if e.name == STEP_RANGE]
    start = min((e.time_range.start for e in steps), default=0.0)
    seq_op, fwd_group, cat_index = {}, {}, {}
    cats = 0

    def module(e):
        for a in _ancestors(e):
            if a.name.startswith(MODULE_RANGE) and a is not e:
                return a.name[len(MODULE_RANGE):]
        return None

    def autograd_op(e):  # the nearest enclosing op at autograd's level (it has a sequence nr)
        for a in _ancestors(e):
            if a.name.startswith(MODULE_RANGE):
                return None
            if a.sequence_nr >= 0 and a.name.startswith("aten::"):
                return a
        return None

    # forward: the group of every autograd-level op, and which op made each autograd node
    for e in cpu_events:  # in order of their start
        if e.name == MODULE_RANGE:  # the model's own range: a forward pass starts
            cats = 0
        if not e.name.startswith("aten::") or e.sequence_nr < 0 or any(
                a.name.startswith(EVALUATE) or a.name == OPT_RANGE for a in _ancestors(e)):
            continue  # not an autograd-level op of the forward
        mod = module(e)
        name = op_name(e.name)
        if name == "cat" and mod == "":
            cat_index[id(e)], cats = cats, cats + 1
        group = step.classify(mod, name, cat_index.get(id(e)))
        fwd_group[id(e)] = group
        seq_op[e.sequence_nr] = group  # the last-started op of a sequence nr made the node

    times, unattributed = {g: 0.0 for g in step.groups}, {}

    def place(e):
        """The group of event e, or (None, why)."""
        chain = list(_ancestors(e))
        if any(a.name == OPT_RANGE for a in chain):
            return "optimizer", ""
        ev = next((a for a in chain if a.name.startswith(EVALUATE)), None)
        if ev is not None:  # backward
            node = ev.name[len(EVALUATE):]
            group = seq_op.get(ev.sequence_nr)
            below = chain[:chain.index(ev)]  # e ... the child of ev
            top = below[-1] if below else ev
            if top.name != node:  # the engine's own work after the node: casts and sums
                if op_name(top.name) in CASTS:
                    return step.cast_group, ""
                if op_name(top.name) in ("add", "add_"):
                    return (group if group == "loss" else step.accumulation_group), ""
            else:
                inner = below[-2] if len(below) > 1 else None
                if inner is not None and op_name(inner.name) in CASTS:
                    return step.cast_group, ""
            return (group, "") if group else (None, f"autograd node {node}")
        op = autograd_op(e)
        if op is None and not e.name.startswith("aten::"):
            return None, "Python between ops (hooks, module calls, the step's own ranges)"
        mod = module(e)
        if op is not None:
            group = fwd_group.get(id(op)) or step.classify(mod, op_name(op.name))
        else:  # an op below autograd's level outside any autograd op (e.g. the loss's seed)
            group = step.classify(mod, op_name(e.name))
        return (group, "") if group in times else (None, f"other: {e.name}")

    kernel_total = 0.0
    for e in cpu_events:
        t = sum(k.duration for k in e.kernels) / 1e3 if gpu else e.self_cpu_time_total / 1e3
        if t <= 0:
            continue
        group, why = place(e)
        if group is None:
            unattributed[why] = unattributed.get(why, 0.0) + t
        else:
            times[group] += t
    if gpu:
        kernel_total = sum(e.time_range.elapsed_us() for e in events
                           if e.device_type.name == "CUDA" and e.time_range.start >= start) / 1e3
        launched = sum(times.values()) + sum(unattributed.values())
        if kernel_total - launched > 1e-3:
            unattributed["kernels launched outside any op"] = kernel_total - launched
    return {"times_ms": times, "unattributed_ms": unattributed, "kernel_ms": kernel_total}


def measure_model(name: str, small: bool, device, rates: dict, warmup: int, timed: int,
                  profiled: int, memory_format: str = "auto") -> dict:
    """Time and profile a model's compute-only steps; the table's rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    gpu = device.type == "cuda"
    t0 = time.perf_counter()
    model, step, smodel, cfg, layout = build_case(name, small, device, memory_format)
    for _ in range(warmup):
        step()
    if gpu:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    step_ms = time_calls(step, 3, timed, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    # one step under the profiler first (its own start-up costs; its events are left out),
    # then the profiled steps, each in a STEP_RANGE
    with ModuleRanges(model), profile(activities=activities) as prof:
        with torch.profiler.record_function(WARMUP_RANGE):
            step()
        if gpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(profiled):
            with torch.profiler.record_function(STEP_RANGE):
                step()
        if gpu:
            torch.cuda.synchronize()
        profiled_ms = 1e3 * (time.perf_counter() - t1) / profiled
    found = attribute(prof.events(), smodel, gpu)
    rows = smodel.rows(rates["matmul_flops_per_s"], rates["bytes_per_s"])
    for r in rows:
        r["measured_ms"] = found["times_ms"][r["group"]] / profiled
        r["ratio"] = r["measured_ms"] / r["floor_ms"] if r["floor_ms"] else None
    attributed = sum(r["measured_ms"] for r in rows)
    # the rest of the profiled step: on a GPU the step (timed without the profiler) less the
    # attributed kernels; on a CPU the profiled step's wall time less the attributed ops
    unattributed = {k: v / profiled for k, v in found["unattributed_ms"].items()}
    if gpu:
        unattributed["GPU idle between kernels"] = max(
            0.0, step_ms - found["kernel_ms"] / profiled)
    else:
        unattributed["not in any op (Python, profiler)"] = max(
            0.0, profiled_ms - attributed - sum(unattributed.values()))
    return {"model": name, "config": f"config {cfg.name}" + (" at toy sizes" if small else ""),
            "batch": smodel.batch,
            "precision": ("bf16 autocast" if gpu else "fp32") + (
                f", {layout}" if name == "unet" else ""), "rows": rows,
            "unattributed_ms": unattributed, "step_ms": step_ms, "profiled_step_ms": profiled_ms,
            "roofline_ms": sum(r["floor_ms"] for r in rows), "attributed_ms": attributed,
            "kernel_ms": found["kernel_ms"] / profiled if gpu else None,
            "flops": sum(r["flops"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
            "first_steps_s": first_s}


# -------------------------------------------------------------------------------------- output

def _num(v: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}" if v else "0"


def _ms(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 1 else f"{v:.2f}")


def markdown(result: dict) -> str:
    rates = result["rates"]
    out = [f"{result['device']}; torch {result['torch']}; matmul "
           f"{_num(rates['matmul_flops_per_s'], 'FLOP/s')} ({rates['matmul']}), bandwidth "
           f"{_num(rates['bytes_per_s'], 'B/s')} ({rates['copy']})"]
    for m in result["models"]:
        out.append("")
        if "skipped" in m:
            out.append(f"**{m['model']}**: {m['skipped']}")
            continue
        out += [f"**{m['model']}** ({m['config']}, batch {m['batch']}, {m['precision']}, "
                f"fused Adam; per step):", "",
                "| group | FLOPs | bytes | floor ms | bound | measured ms | measured/floor |",
                "|---|---:|---:|---:|---|---:|---:|"]
        for r in m["rows"]:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
            out.append(f"| {r['group']} | {_num(r['flops'], 'FLOP')} | {_num(r['bytes'], 'B')} | "
                       f"{_ms(r['floor_ms'])} | {r['bound']} | {_ms(r['measured_ms'])} | {ratio} |")
        un = sum(m["unattributed_ms"].values())
        parts = ", ".join(f"{k} {_ms(v)}" for k, v in sorted(m["unattributed_ms"].items(),
                                                              key=lambda kv: -kv[1]) if v > 0)
        out.append(f"| unattributed | | | | | {_ms(un)} | |")
        ratio = m["attributed_ms"] / m["roofline_ms"] if m["roofline_ms"] else 0
        out.append(f"| **total** | {_num(m['flops'], 'FLOP')} | {_num(m['bytes'], 'B')} | "
                   f"{_ms(m['roofline_ms'])} | | {_ms(m['attributed_ms'])} | {ratio:.1f}x |")
        out += ["", f"Step: roofline {_ms(m['roofline_ms'])} ms (the sum of the floors), "
                f"measured {_ms(m['step_ms'])} ms without the profiler "
                f"({m['step_ms'] / m['roofline_ms']:.1f}x the roofline), "
                f"{_ms(m['profiled_step_ms'])} ms profiled; attributed {_ms(m['attributed_ms'])} "
                f"ms" + (f" of {_ms(m['kernel_ms'])} ms of kernels" if m["kernel_ms"] else "")
                + (f"; unattributed: {parts}" if parts else "") + "."]
    return "\n".join(out)


def run(small: bool = False, budget: float = 300.0, models=("vit", "unet"),
        memory_format: str = "auto") -> dict:
    """Measure the device and each model within ``budget`` seconds; the result with its
    ``markdown``. ``small``: toy sizes in fp32 on the CPU. ``memory_format``: the U-Net's
    (the setting; auto: the project's choice, channels-last on a GPU in bf16)."""
    import torch
    t_end = time.monotonic() + budget
    device = torch.device("cuda" if torch.cuda.is_available() and not small else "cpu")
    gpu = device.type == "cuda"
    if gpu:
        torch.backends.cudnn.benchmark = True  # as the project's runs
        device_name = (f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, "
                       f"cuDNN {torch.backends.cudnn.version()}")
    else:
        device_name = f"CPU ({torch.get_num_threads()} threads)"
    result = {"device": device_name, "torch": torch.__version__, "small": small,
              "rates": device_rates(device, small), "models": []}
    warmup, timed, profiled = (3, 10, 3) if gpu else (1, 2, 2)
    need_s = 60 if gpu else 2  # the least time a model's steps are started in
    for m in models:
        left = t_end - time.monotonic()
        result["models"].append(
            {"model": m, "skipped": f"skipped: {left:.0f} s of the budget left"} if left < need_s
            else measure_model(m, small, device, result["rates"], warmup, timed, profiled,
                               memory_format))
    result["markdown"] = markdown(result)
    return result


def main(argv=None):
    p = OneLineParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true",
                   help="toy models in fp32 on the CPU (seconds), whatever the machine")
    p.add_argument("--budget", type=at_least(1.0, float), default=300.0,
                   help="seconds for everything; models that no longer fit are skipped "
                        "(default: %(default)g)")
    p.add_argument("--only", nargs="+", choices=["vit", "unet"], default=["vit", "unet"],
                   help="the models to measure (default: both)")
    p.add_argument("--memory-format", default="auto",
                   choices=["auto", "contiguous", "channels_last"],
                   help="the U-Net's layout (default: %(default)s, the project's choice: "
                        "channels-last on a GPU in bf16, where its first step autotunes ~45 s)")
    p.add_argument("--json", type=new_file, default=None,
                   help="also write the result to this JSON file (a new file: never written over)")
    a = p.parse_args(argv)
    result = run(a.small, a.budget, a.only, a.memory_format)
    if a.json:
        with open(a.json, "x") as f:
            json.dump(result, f, indent=1)
    print(result["markdown"])


if __name__ == "__main__":
    main()
