"""Memory per rank of the model-parallel ViT, measured by the engine, beside the memory model.

    python -m benchmarks.mp_memory                    # every variant below, Markdown tables
    python -m benchmarks.mp_memory --only fp32        # or: bf16, checkpointing, padded, off (updates those
                                                      # entries of measured.json, keeps the others)
    python -m benchmarks.mp_memory --engine_log       # also run train_mp.py under torchrun (tp=4)
                                                      # and read its "Memory after forward pass" line
    python -m benchmarks.mp_memory --only fsdp        # FSDP on 1, 2 and 4 data-parallel ranks

Measured: the ``mp_cpu`` config (the mp model's shape scaled down for a CPU: 96 x 192 image,
patch 8, embed 768, depth 4, heads 8, batch 4) at tp = 1, 2, 4, cp = 2 and tp = 2 x cp = 2
(world = tp x cp, dp = 1), each layout on real gloo ranks (``tests.distributed_harness.run_ranks``).
The ``padded`` variant crops the image to 80 x 184 (10 patch rows of 23 columns): tp=4 and
tp=2 x cp=2 do not divide the rows, so the engine splits each cp band's tokens into padded tp
chunks (230 tokens -> 4 x 58, 2 padding tokens; 115 per cp band -> 2 x 58, 1 padding token);
tp=2 divides them (row bands). The ``off`` variant runs the same shapes with
``--sequence_parallel false``.
Every rank builds the engine (``train.Trainer``: the serial model, parallelized when tp
or cp > 1, DDP over dp with the replicated-gradient hook) and runs two training steps; the second
is measured with the engine's own ``MemoryProbe`` (on a CPU: bytes of parameters, gradients, Adam
state and the tensors saved for backward, each storage once), so Adam's state exists as in any
later step of a run. "After forward" is the probe right after the forward pass (gradients were
freed by ``zero_grad(set_to_none=True)``), "peak" adds the gradients of the backward pass. The
process resident peak (VmHWM) is shown as an upper bound that includes the interpreter,
libraries, gloo buffers and short-lived temporaries.

Predicted: ``benchmarks.memory_model`` for the same config and layout with ``--measure cpu``
(the quantities the CPU probe counts; the token layout as the engine chooses it). Then the
model's prediction for the full ``mp`` config on 80 GB GPUs (fp16, flash attention, local batch
16 as in the reference runs, dp = 4): 360 x 720 as configured (45 patch rows: padded sequence
parallelism at tp = 4), 352 x 720 (44 rows: row bands), and 360 x 720 with sequence parallelism
off for comparison.

FSDP (``--only fsdp``): the same ``mp_cpu`` model with ``--fsdp`` on 2 and 4 gloo ranks (dp = 2,
4; tp = cp = 1) beside one process (no sharding). Each rank takes a warm-up step and then one
forward/backward/Adam update without clearing the gradients, and counts the storage of its
parameters, gradients and Adam state (each storage once: this rank's shards of the DTensors) and
the most weight bytes held gathered at once (read in each block's forward, while that block is
gathered: the gathered block and the root unit). Predicted: ``benchmarks.memory_model`` with
``fsdp`` (1/N of the serial figure plus the root and the largest block).

Results are written to benchmarks/mp_memory/measured.json; RESULTS.md holds the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory_model import Shape, predict, predict_config  # noqa: E402
from settings.parse import build_config  # noqa: E402

GiB = 1024**3
MiB = 1024**2
YAML = os.path.join(ROOT, "config", "ViT.yaml")
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
VARIANTS = {  # name: (extra overrides, layouts)
    "fp32": ({}, LAYOUTS),
    "bf16": ({"amp_mode": "bf16"}, [(1, 1), (4, 1)]),
    "checkpointing": ({"activation_checkpointing": "true"}, [(1, 1), (4, 1)]),
    "padded": ({"img_size": "[80,184]"}, [(1, 1), (2, 1), (4, 1), (2, 2)]),
    "off": ({"img_size": "[80,184]", "sequence_parallel": "false"}, [(1, 1), (4, 1), (2, 2)]),
}


def overrides(tp, cp, expdir, extra):
    return {"tensor_parallel": str(tp), "context_parallel": str(cp), "expdir": expdir, "num_iters": "2",
            "device": "cpu", "log_every": "1000", **extra}


def _resident_bytes() -> int:
    """VmRSS of this process (Linux), 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _measure_rank(config, ov):
    """On one rank: the engine, one warm-up step, one measured step; the probe's numbers."""
    import contextlib

    import torch

    from observe.memory import MemoryProbe, NullProbe, resident_peak_bytes, tensor_bytes
    from engine.runtime import setup_runtime
    from train import Trainer

    start_rss = _resident_bytes()  # interpreter, torch and gloo, before the run
    cfg = build_config(YAML, config, ov)
    rt = setup_runtime(cfg)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        trainer = Trainer(cfg, rt)  # its log (resolved config, layout) goes to the run's out.log
    trainer.loaders.train_sampler.set_epoch(0)
    trainer.model.train()
    probe = MemoryProbe(trainer.device, trainer.model, trainer.optimizer)
    batches = iter(trainer.loaders.train)
    for i in range(2):
        x, y = trainer.to_device(*next(batches))
        trainer.train_step(x, y, probe if i == 1 else NullProbe())
    params = tensor_bytes(trainer.model.parameters())
    adam = tensor_bytes(v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return dict(after_forward=probe.after_forward, peak=probe.peak, params=params, adam=adam,
                saved=probe.after_forward - params - adam, vmhwm=resident_peak_bytes(), start_rss=start_rss,
                model=type(trainer.model).__name__)


def _measure_fsdp_rank(config, ov):
    """On one rank of an FSDP run: a warm-up step, then one update without clearing the
    gradients; bytes of this rank's parameters, gradients and Adam state, and the most weight
    bytes gathered at once."""
    import contextlib

    import torch
    from torch.distributed.tensor import DTensor

    from engine.runtime import setup_runtime
    from engine.sharding import resharded
    from observe.memory import tensor_bytes
    from train import Trainer

    cfg = build_config(YAML, config, ov)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        trainer = Trainer(cfg, setup_runtime(cfg))
    model = trainer.model
    gathered = [0]

    def note_gathered(module, args):  # inside a block: its weights (and the root's) are gathered
        gathered[0] = max(gathered[0], sum(p.numel() * p.element_size() for p in model.parameters()
                                           if not isinstance(p, DTensor)))

    for block in trainer.task.blocks(model):
        next(block.children()).register_forward_pre_hook(note_gathered)
    trainer.loaders.train_sampler.set_epoch(0)
    model.train()
    batches = iter(trainer.loaders.train)
    trainer.train_step(*trainer.to_device(*next(batches)))
    trainer.update(*trainer.to_device(*next(batches)))  # the gradients stay for the count
    resharded(model)
    params = tensor_bytes(model.parameters())
    grads = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    adam = tensor_bytes(v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return dict(params=params, grads=grads, adam=adam, gathered=gathered[0], model=type(model).__name__)


def run_fsdp(results):
    """FSDP on 1 (no sharding), 2 and 4 ranks: measured per-rank state beside the prediction."""
    from tests.distributed_harness import run_ranks

    rows = []
    for n in (1, 2, 4):
        print(f"[fsdp] {n} rank(s) ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="mp_memory-fsdp-") as tmp:
            ov = {"fsdp": "true", "expdir": tmp, "num_iters": "2", "device": "cpu", "log_every": "1000"}
            ranks = run_ranks(_measure_fsdp_rank, n, "mp_cpu", ov, timeout=900)
        cfg = build_config(YAML, "mp_cpu", ov)
        p = predict_config(cfg, n, "flash", "cpu")
        rows.append(dict(ranks=n, measured=ranks, predicted=dict(params=p.params, grads=p.grads, adam=p.adam,
                                                                 gathered=p.gathered)))
    serial = rows[0]["measured"][0]
    whole = serial["params"] + serial["grads"] + serial["adam"]
    print("\n### FSDP: per-rank parameters + gradients + Adam state (MiB), measured (max over ranks) vs "
          "predicted, and the weights held gathered at once\n")
    print("| ranks | params + grads + Adam meas. / pred. | serial / N | meas. / (serial / N) "
          "| gathered at once meas. / pred. |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        m = max(r["measured"], key=lambda x: x["params"] + x["grads"] + x["adam"])
        got = m["params"] + m["grads"] + m["adam"]
        pr = r["predicted"]
        print(f"| {r['ranks']} | {fmt_mib(got)} / {fmt_mib(pr['params'] + pr['grads'] + pr['adam'])} "
              f"| {fmt_mib(whole / r['ranks'])} | {got / (whole / r['ranks']):.1%} "
              + (f"| {fmt_mib(m['gathered'])} / {fmt_mib(pr['gathered'])} |" if r["ranks"] > 1
                 else "| - (nothing sharded) |"))
    results["fsdp"] = rows
    return rows


def measure(tp, cp, extra, timeout=900):
    from tests.distributed_harness import run_ranks

    with tempfile.TemporaryDirectory(prefix="mp_memory-") as tmp:
        return run_ranks(_measure_rank, tp * cp, "mp_cpu", overrides(tp, cp, tmp, extra), timeout=timeout)


def ensure_data():
    """The mp_cpu synthetic data, made once here rather than inside the first ranks."""
    from datapipe.data_loader import has_data, synthesize

    cfg = build_config(YAML, "mp_cpu", {})
    if not has_data(cfg):
        print(f"making the mp_cpu synthetic data under {cfg.data_root} ...", flush=True)
        synthesize(cfg)


def engine_log(tp, cp, extra=None):
    """train_mp.py under torchrun, two epochs of 2 steps: the second epoch's logged memory line
    (measured with Adam state present). Returns (after forward GiB per rank, peak GiB per rank)."""
    with tempfile.TemporaryDirectory(prefix="mp_memory-log-") as tmp:
        args = ["--config", "mp_cpu", "--tensor_parallel", str(tp), "--context_parallel", str(cp),
                "--expdir", tmp, "--num_epochs", "2", "--limit_nsamples", "8", "--limit_nsamples_val", "4",
                "--device", "cpu"]
        for k, v in (extra or {}).items():
            args += [f"--{k}", str(v)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * cp}",
               os.path.join(ROOT, "train_mp.py"), *args]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        text = r.stdout + r.stderr
        if r.returncode:
            raise RuntimeError(f"train_mp.py failed ({r.returncode}):\n{text[-3000:]}")
        lines = re.findall(r"Memory after forward pass \(Gi?B, per rank\): ([0-9., ]+); peak: ([0-9., ]+)", text)
        fwd, peak = lines[-1]
        return [float(v) for v in fwd.split(",")], [float(v) for v in peak.split(",")]


def fmt_mib(b):
    return f"{b / MiB:.2f}"


def run_variant(name, extra, layouts, results):
    rows = []
    for tp, cp in layouts:
        print(f"[{name}] tp={tp} cp={cp} ...", flush=True)
        ranks = measure(tp, cp, extra)
        cfg = build_config(YAML, "mp_cpu", overrides(tp, cp, "/tmp", extra))
        p = predict_config(cfg, 1, "flash", "cpu")
        worst = max(ranks, key=lambda r: r["peak"])
        rows.append(dict(variant=name, tp=tp, cp=cp, ranks=ranks, model=worst["model"],
                         sequence_parallel=p.sequence_parallel if tp > 1 else None, padding=p.padding,
                         padded=_layout(cfg, tp, cp, cfg.sequence_parallel).padded,
                         predicted=dict(params=p.params, adam=p.adam, activations=p.activations,
                                        after_forward=p.after_forward, peak=p.peak)))
    base = rows[0]["ranks"][0]["peak"]
    base_pred = rows[0]["predicted"]["peak"]
    print(f"\n### {name}: measured (MemoryProbe, max over ranks) vs predicted (memory model), MiB per rank\n")
    print("| tp | cp | seq. par. | activations meas. / pred. | after forward meas. / pred. | peak meas. / pred. "
          "| peak / tp=1 meas. / pred. | VmHWM (max) | VmHWM - RSS at start |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m = max(r["ranks"], key=lambda x: x["peak"])
        same = len({(x["after_forward"], x["peak"]) for x in r["ranks"]}) == 1
        pr = r["predicted"]
        sp = {None: "-", True: "on", False: "off"}[r["sequence_parallel"]]
        if r["padded"]:
            sp = f"on, padded (+{r['padding']})"
        print(f"| {r['tp']} | {r['cp']} | {sp} | {fmt_mib(m['saved'])} / {fmt_mib(pr['activations'])} "
              f"| {fmt_mib(m['after_forward'])} / {fmt_mib(pr['after_forward'])} "
              f"| {fmt_mib(m['peak'])} / {fmt_mib(pr['peak'])}{'' if same else ' (ranks differ)'} "
              f"| {m['peak'] / base:.1%} / {pr['peak'] / base_pred:.1%} "
              f"| {max(x['vmhwm'] for x in r['ranks']) / MiB:.0f} "
              f"| {max(x['vmhwm'] - x['start_rss'] for x in r['ranks']) / MiB:.0f} |")
    results[name] = rows
    return rows


def _layout(cfg, tp, cp, sequence_parallel=True):
    from distributed.parallelize import token_layout

    return token_layout(cfg.img_size, cfg.patch_size, tp, cp, sequence_parallel)


def gpu_predictions():
    """The full mp config on 80 GB GPUs: fp16, flash attention, local batch 16, dp = 4."""
    out = []
    print("\n### Model: full mp config (embed 1536, patch 8, depth 12), fp16, flash attention, "
          "local batch 16, dp 4, GiB per rank\n")
    print("| img | tp | cp | sequence parallelism | params+grads+Adam | activations | DDP buckets + batch "
          "| after forward | peak | after forward / tp=1 | peak / tp=1 |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    cases = [([360, 720], True, ((1, 1), (2, 1), (4, 1))), ([352, 720], True, ((1, 1), (2, 1), (4, 1), (2, 2))),
             ([360, 720], False, ((1, 1), (2, 1), (4, 1)))]
    for img, sp, layouts in cases:
        base = None
        for tp, cp in layouts:
            cfg = build_config(YAML, "mp", {"tensor_parallel": str(tp), "context_parallel": str(cp),
                                            "local_batch_size": "16", "img_size": str(img)})
            rows = img[0] // cfg.patch_size
            p = predict(Shape.from_config(cfg, 16), tp, cp, 4, True, "flash", False, "cuda", cfg.bucket_cap_mb, sp)
            lay = _layout(cfg, tp, cp, sp)
            base = base or p
            if tp == 1:
                mode = "-"
            elif lay.row_bands:
                mode = f"on ({rows} rows / {tp * cp})"
            elif lay.padded:
                mode = f"on, padded ({lay.band_tokens} tokens -> {tp} x {lay.local_tokens})"
            else:
                mode = "**off**"
            print(f"| {img[0]}x{img[1]} | {tp} | {cp} | {mode} | {(p.params + p.grads + p.adam) / GiB:.2f} "
                  f"| {p.activations / GiB:.2f} | {sum(p.extra.values()) / GiB:.2f} | {p.after_forward / GiB:.2f} "
                  f"| {p.peak / GiB:.2f} | {p.after_forward / base.after_forward:.1%} | {p.peak / base.peak:.1%} |")
            out.append(dict(img=img, tp=tp, cp=cp, sequence_parallel=p.sequence_parallel, padding=p.padding,
                            after_forward=p.after_forward, peak=p.peak, activations=p.activations, params=p.params,
                            adam=p.adam, extra=p.extra))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(VARIANTS) + ["gpu", "fsdp"], action="append",
                    help="measure this variant only (repeatable); the others in --out are kept")
    ap.add_argument("--engine_log", action="store_true",
                    help="also run train_mp.py (tp=4) and compare its logged memory line")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "mp_memory", "measured.json"),
                    help="JSON file of the measurements (default: %(default)s)")
    args = ap.parse_args(argv)
    ensure_data()
    results = {}
    if args.only and os.path.exists(args.out):  # update the variants run now, keep the others
        with open(args.out) as f:
            results = {k: v for k, v in json.load(f).items()
                       if k in VARIANTS or k.startswith("engine") or k == "fsdp"}
    for name, (extra, layouts) in VARIANTS.items():
        if not args.only or name in args.only:
            run_variant(name, extra, layouts, results)
    if not args.only or "fsdp" in args.only:
        run_fsdp(results)
    results["gpu_model"] = gpu_predictions()
    if args.engine_log:
        fwd, peak = engine_log(4, 1)
        print(f"\ntrain_mp.py --config mp_cpu --tensor_parallel 4, epoch 2: after forward {fwd} GiB, peak {peak} GiB")
        results["engine_log_tp4"] = dict(after_forward_gb=fwd, peak_gb=peak)
        fwd, peak = engine_log(4, 1, VARIANTS["padded"][0])
        print(f"train_mp.py --config mp_cpu --img_size [80,184] --tensor_parallel 4 (padded), epoch 2: after "
              f"forward {fwd} GiB, peak {peak} GiB")
        results["engine_log_tp4_padded"] = dict(after_forward_gb=fwd, peak_gb=peak)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nwritten: {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
