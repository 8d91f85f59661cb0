"""Options that keep a model's numbers but change its step's speed, timed on one GPU: the
attention kernels of the ViT and whole compute-only steps of both models.

    python -m benchmarks.step_options --dry-run          # the variants and their time limits
    python -m benchmarks.step_options                    # everything (about 4 minutes on an H200)
    python -m benchmarks.step_options --only attention   # or: vit, unet

``attention``: ``scaled_dot_product_attention`` alone at the ViT's shapes (the tutorial's short
config: batch 16, 8 heads of 48, 45 x 90 = 4050 tokens), each backend that torch has (flash, cuDNN,
memory-efficient, math) in bf16 and fp16, forward and forward + backward, from the QKV projection's
output (B, N, 3E) to the attention's (B, N, E); q, k and v as the model makes them (strided views
of the fused QKV projection split on its own dimension, ``qkv``), split on a permuted view as
before (``qkv-permuted``: its backward copies the QKV gradient once more), as contiguous tensors
(``contig``), and padded with zeros to heads of 64 (``pad64``: the same scores and output, for
kernels tuned for 64); the fastest forward + backward in bf16 of the model's own layout is the
"fastest" of the compiled ViT variants. Milliseconds per call (median of timed rounds, CUDA events)
and TFLOP/s of the attention's own FLOPs (4 N^2 d per head forward; forward + backward 3.5x that,
the backward counted as FlashAttention's papers count it).

``vit`` and ``unet``: compute-only training steps (a batch on the GPU reused, bf16 autocast, fused
Adam, the task's loss) of the short configs' models, one variant per child process (compile caches
off, so each compile is timed from cold), in this order: the ViT eager per attention backend; the
U-Net in the default layout and in ``channels_last_3d``, eager and compiled; the ViT compiled with
the fastest attention (default mode, ``max-autotune-no-cudagraphs``, and ``blocks``: each
transformer block compiled on its own, as ``compile_blocks`` does, in the default mode).
``heuristics`` (not in the default): the U-Net eager in both layouts with cuDNN's heuristics
instead of its autotuning (``cudnn.benchmark`` off): what the autotuning costs at the start and
gains per step. Per variant: milliseconds per step (median of timed rounds), samples/s, TFLOP/s and
MFU (the task's model FLOPs), and the seconds to the first step (model, compile, autotuning; with
``--warm`` each compiled variant runs again on the compile caches its first run filled, as a later
run of a config would). A variant that fails prints its error's last line; one that runs past its
limit says so. The table is printed last; ``--json`` also writes it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from settings.errors import ConfigError, OneLineParser, at_least, new_file, refuse  # noqa: E402

BACKENDS = ("flash", "cudnn", "efficient", "math")
# (name, config args, per-variant options); the options a child understands are in child().
# In the order they run: the eager variants first, so a short budget still compares them.
VIT = [(f"{b} eager", {"attention": b, "compile": "eager"}) for b in ("flash", "cudnn", "efficient")]
UNET = [(f"{fmt} {mode}", {"layout": fmt, "compile": mode})
        for mode in ("eager", "default") for fmt in ("contiguous", "channels_last")]
HEURISTICS = [(f"{fmt} eager, cuDNN's heuristics (no autotuning)",
               {"layout": fmt, "compile": "eager", "cudnn_benchmark": False})
              for fmt in ("contiguous", "channels_last")]
VIT_COMPILED = [(f"fastest ({mode})", {"attention": "best", "compile": mode})
                for mode in ("default", "max-autotune-no-cudagraphs", "blocks")]
LIMIT_S = {"eager": 60, "default": 150, "max-autotune-no-cudagraphs": 200, "blocks": 100}


# ------------------------------------------------------------------------- in a child process

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


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


LAYOUTS = ("qkv", "qkv-permuted", "contig", "pad64")


def attention_rows(batch=16, heads=8, tokens=4050, head_dim=48, device="cuda") -> list[dict]:
    """One row per dtype, layout and backend (a backend without a kernel: its error). The
    input is the QKV projection's output (B, N, 3E), its gradient what the step's backward
    hands to the projection."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    rows = []
    flops_fwd = 4 * batch * heads * tokens * tokens * head_dim
    for dtype in (torch.bfloat16, torch.float16):
        qkv = torch.randn(batch, tokens, 3 * heads * head_dim, device=device, dtype=dtype,
                          requires_grad=True)
        for layout in LAYOUTS:
            def attend():
                split = qkv.view(batch, tokens, 3, heads, head_dim)
                if layout == "qkv-permuted":  # the split before: its backward copies once more
                    q, k, v = split.permute(2, 0, 3, 1, 4)
                else:  # the model's (networks.vit.Attention)
                    q, k, v = (t.transpose(1, 2) for t in split.unbind(2))
                if layout == "contig":
                    q, k, v = (t.contiguous() for t in (q, k, v))
                if layout == "pad64":  # zeros to a head of 64: the same scores, the same output
                    q, k, v = (F.pad(t, (0, 64 - head_dim)) for t in (q, k, v))
                    out = F.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5)[
                        ..., :head_dim]
                else:
                    out = F.scaled_dot_product_attention(q, k, v)
                return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)  # (B, N, E)
            for name in BACKENDS if layout != "pad64" else BACKENDS[:3]:
                row = {"dtype": str(dtype).split(".")[-1], "layout": layout, "backend": name}
                try:
                    with sdpa_kernel([sdpa_backend(name)]):
                        def fwd():
                            with torch.no_grad():
                                attend()

                        def fwd_bwd():
                            attend().sum().backward()
                        fwd()
                        fwd_bwd()
                        rounds = (2, 2) if name == "math" else (5, 10)
                        row["fwd_ms"] = time_calls(fwd, *rounds)
                        row["fwd_bwd_ms"] = time_calls(fwd_bwd, *rounds)
                    row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
                    row["fwd_bwd_tflops"] = 3.5 * flops_fwd / row["fwd_bwd_ms"] / 1e9
                except Exception as e:  # no kernel for this shape or dtype
                    row["failed"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
                qkv.grad = None
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def step_row(model_name: str, opts: dict, steps: int) -> dict:
    """One compute-only variant: its step time, rate, FLOPs and time to the first step.
    ``opts["overrides"]``: settings over the short config's (smaller models for a test); on a
    machine without CUDA the step runs on the CPU."""
    t0 = time.perf_counter()

    import torch
    from torch.nn.attention import sdpa_kernel

    from engine.optimizer import build_optimizer
    from observe.flops import peak_tflops
    from settings.parse import build_config
    from tasks import make_task
    torch.backends.cudnn.benchmark = opts.get("cudnn_benchmark", True)
    yaml = {"vit": "config/ViT.yaml", "unet": "config/UNet.yaml"}[model_name]
    cfg = build_config(yaml, "short", {"amp_mode": "bf16", **opts.get("overrides", {})})
    task = make_task(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = task.build_model().to(device)
    fmt = torch.channels_last_3d if opts.get("layout") == "channels_last" else \
        torch.contiguous_format
    model = model.to(memory_format=fmt)
    batch = cfg.global_batch_size
    if model_name == "vit":
        x = torch.randn(batch, cfg.n_in_channels, *cfg.img_size, device=device)
        y = torch.randn(batch, cfg.n_out_channels, *cfg.img_size, device=device)
    else:
        side = cfg.data_size
        x = torch.randn(batch, cfg.n_in_channels, side, side, side, device=device)
        y = torch.randn(batch, cfg.n_out_channels, side, side, side, device=device)
        x, y = x.contiguous(memory_format=fmt), y.contiguous(memory_format=fmt)
    optimizer = build_optimizer(model.parameters(), 1e-4, (0.9, 0.95), True, device)
    attention = opts.get("attention")
    kernels = (lambda: sdpa_kernel([sdpa_backend(attention)])) if attention in BACKENDS \
        else contextlib.nullcontext
    step_model = model
    if opts["compile"] == "blocks":  # compile_blocks: each block in place, the rest eager
        for block in task.blocks(model):
            block.compile()
    elif opts["compile"] != "eager":
        step_model = torch.compile(model, mode=None if opts["compile"] == "default"
                                   else opts["compile"])

    step = compute_only_step(task, step_model, optimizer, x, y, torch.bfloat16, kernels)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(3):
        step()
    ms = time_calls(step, rounds=3, calls=steps)
    rate = batch * 1000 / ms
    tflops = task.flops_per_sample() * rate / 1e12
    peak = peak_tflops(device, "bf16")
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"model": model_name, "ms": ms, "samples_per_s": rate, "tflops": tflops,
            "mfu": 100 * tflops / peak if peak else None, "first_step_s": first_s,
            "peak_gb": peak_gb}


def child(argv):
    kind = argv[0]
    if kind == "attention":
        import torch
        attention_rows(*json.loads(argv[1]), device="cuda" if torch.cuda.is_available() else "cpu")
        return
    opts = json.loads(argv[2])
    if opts.get("attention") == "best":
        opts["attention"] = argv[3]
    if len(argv) > 5:
        opts["overrides"] = json.loads(argv[5])
    print(json.dumps(step_row(argv[1], opts, int(argv[4]) if len(argv) > 4 else 10)), flush=True)


# ------------------------------------------------------------------------- the parent

def run_child(args: list[str], limit: float, cache_dir: str = "") -> tuple[list[dict], str]:
    """One child; its compile caches off, or in ``cache_dir``."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    env = dict(os.environ, PYTHONUNBUFFERED="1", **caches)
    cmd = [sys.executable, "-m", "benchmarks.step_options", "--child", *args]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return [], f"over its {limit:g} s limit"
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    if p.returncode and not rows:
        last = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return [], f"exit {p.returncode}: {last[0][:200]}"
    return rows, ""


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def first_step(row: dict) -> str:
    """Seconds to the first step: cold, and "cold / warm" where a warm run was made."""
    cold = f"{row['first_step_s']:.1f}"
    if "warm_first_step_s" not in row:
        return cold
    return f"{cold} / {fmt(row['warm_first_step_s'], '.1f')}"


def check_vit_overrides(text: str):
    """``--vit-overrides``: a JSON object of settings the ViT's short config takes; refused in
    one line before any variant runs (a child would fail on it, every ViT row with it)."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        refuse(f"--vit-overrides {text!r} is not valid JSON ({e}): give an object, e.g. "
               f"'{{\"img_size\": [64, 128]}}'")
    if not isinstance(overrides, dict):
        refuse(f"--vit-overrides {text!r} is not a JSON object of settings: give one, e.g. "
               f"'{{\"img_size\": [64, 128]}}'")
    from settings.parse import build_config

    try:
        build_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "config", "ViT.yaml"), "short", {"amp_mode": "bf16", **overrides})
    except ConfigError as e:
        refuse(f"--vit-overrides {text!r}: {e}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return
    p = OneLineParser(prog="python -m benchmarks.step_options",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=["attention", "vit", "unet", "heuristics"],
                   default=["attention", "vit", "unet"],
                   help="groups of variants (default: %(default)s; heuristics: the U-Net eager "
                        "without cuDNN's autotuning)")
    p.add_argument("--budget", type=at_least(1.0, float), default=300.0,
                   help="seconds for all variants; the rest are skipped (default: %(default)g)")
    p.add_argument("--json", type=new_file, default=None,
                   help="also write the rows to this JSON file (a new file: never written over)")
    p.add_argument("--steps", type=at_least(1), default=10, help="steps per timed round (default: "
                   "%(default)s)")
    p.add_argument("--attention-shape", nargs=4, type=at_least(1), default=[16, 8, 4050, 48],
                   metavar=("BATCH", "HEADS", "TOKENS", "HEAD_DIM"),
                   help="the attention rows' shape (default: the short ViT's, %(default)s)")
    p.add_argument("--vit-overrides", default="{}", metavar="JSON",
                   help="settings over the ViT's short config for every ViT variant, e.g. "
                        "'{\"img_size\": [64, 128]}' for a CPU (default: none)")
    p.add_argument("--warm", action="store_true",
                   help="run each compiled variant a second time on the compile caches the first "
                        "filled (a cache directory of its own): its first step then is a later "
                        "run's (the first step s column: cold / warm)")
    p.add_argument("--dry-run", action="store_true", help="list the variants, run nothing")
    a = p.parse_args(argv)
    check_vit_overrides(a.vit_overrides)
    plan = []
    if "attention" in a.only:
        plan.append(("attention", ["attention", json.dumps(a.attention_shape)], 90))
    for group, name, variants in (("vit", "vit", VIT), ("unet", "unet", UNET),
                                  ("heuristics", "unet", HEURISTICS),
                                  ("vit", "vit", VIT_COMPILED)):
        if group in a.only:
            plan += [(f"{name} {label}", ["step", name, json.dumps(o)], LIMIT_S[o["compile"]])
                     for label, o in variants]
    if a.dry_run:
        for label, args, limit in plan:
            print(f"{label}: limit {limit} s")
        print(f"budget {a.budget:g} s")
        return
    t_end = time.monotonic() + a.budget
    out = {"attention": [], "steps": []}
    best = "flash"
    for label, args, limit in plan:
        left = t_end - time.monotonic()
        if left < 15:
            out["steps"].append({"variant": label, "failed": "skipped: budget spent"})
            continue
        if args[0] == "step":
            args = args + [best, str(a.steps)]
            if args[1] == "vit":
                args.append(a.vit_overrides)
        warm = a.warm and args[0] == "step" and json.loads(args[2])["compile"] != "eager"
        cache = tempfile.mkdtemp(prefix="step_options-cache-") if warm else ""
        rows, why = run_child(args, min(limit, left), cache)
        if warm and rows and t_end - time.monotonic() > 15:
            again, why_again = run_child(args, min(limit, t_end - time.monotonic()), cache)
            rows[0]["warm_first_step_s"] = again[0]["first_step_s"] if again else None
            if why_again:
                print(f"{label}, warm: {why_again}", flush=True)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
        if args[0] == "attention":
            out["attention"] = rows
            ok = [r for r in rows if "failed" not in r and r["dtype"] == "bfloat16"
                  and r["layout"] == "qkv"]
            if ok:
                best = min(ok, key=lambda r: r["fwd_bwd_ms"])["backend"]
            if why:
                print(f"attention: {why}", flush=True)
            continue
        row = rows[0] if rows else {"failed": why}
        row["variant"] = label
        out["steps"].append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "x") as f:
            json.dump(out, f, indent=1)
    print(table(out))


def table(out: dict) -> str:
    lines = []
    if out["attention"]:
        lines += ["| dtype | q, k, v | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
                  "fwd+bwd TFLOP/s |", "|---|---|---|---:|---:|---:|---:|"]
        for r in out["attention"]:
            if "failed" in r:
                lines.append(f"| {r['dtype']} | {r['layout']} | {r['backend']} | "
                             f"{r['failed']} | | | |")
            else:
                lines.append(f"| {r['dtype']} | {r['layout']} | {r['backend']} | "
                             f"{r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.2f} "
                             f"| {r['fwd_bwd_tflops']:.0f} |")
        lines.append("")
    if out["steps"]:
        lines += ["| step variant (bf16, fused Adam, compute only) | ms/step | samples/s | "
                  "TFLOP/s | MFU % | first step s | peak GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in out["steps"]:
            if "failed" in r:
                lines.append(f"| {r['variant']} | failed: {r['failed']} | | | | | |")
            else:
                lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r['samples_per_s']:.1f} | "
                             f"{r['tflops']:.0f} | {fmt(r['mfu'], '.1f')} | "
                             f"{first_step(r)} | {fmt(r['peak_gb'], '.1f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
