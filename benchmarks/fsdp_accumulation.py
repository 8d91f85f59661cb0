"""Gradient accumulation under FSDP: a reduce-scatter per micro-batch (the default) against one per
step (``--fsdp_reduce_each_microbatch false``), per-rank memory and step time on gloo ranks.

    python -m benchmarks.fsdp_accumulation                   # mp_cpu ViT, 2 ranks, 4 micro-batches
    python -m benchmarks.fsdp_accumulation --ranks 2 --grad_accum_steps 4 --steps 4 --json out.json

Each setting runs in its own spawn of gloo ranks (``tests.distributed_harness.run_ranks``), so the
resident peaks do not mix. Every rank builds the engine (``train.Trainer``, ``--fsdp``, the
``mp_cpu`` ViT: 96 x 192 image, patch 8, embed 768, depth 4, 28 M parameters, fp32, on batches
made in memory) and takes one warm-up step and ``--steps`` timed steps of ``--grad_accum_steps``
micro-batches. Measured per rank:

* gradient bytes held: the largest, over the timed steps, of this rank's sharded gradients
  (``.grad`` of the DTensor shards) plus the unsharded gradients FSDP2 keeps between
  micro-batches (``held_gradient_bytes``), read before every block's forward of every
  micro-batch (it misses the one block's unsharded gradient that lives inside a backward);
* peak of torch's tensors: one more step under ``torch.profiler`` with ``profile_memory``; the
  largest running sum of its allocations and frees (every tensor the step allocates, temporaries
  included, on every thread) on top of what the rank holds as the step starts (its shards of the
  parameters and Adam state: the gradients were cleared);
* resident peak: the process's VmHWM less its resident size before the engine was built (an
  upper bound that includes gloo's buffers; the C allocator's reuse of freed memory makes it
  vary by tens of MiB between runs);
* step time: the median wall time of the timed steps (2-core CPU: the collectives of the two
  ranks compete with their compute for the same cores).

Predicted: ``benchmarks.memory_model`` (``--measure cpu``) for the same config: the gradients held
between micro-batches, this rank's sharded gradients by default, the whole unsharded fp32 gradient
with ``fsdp_reduce_each_microbatch`` off.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory_model import predict_config  # noqa: E402
from benchmarks.mp_memory import _resident_bytes  # noqa: E402
from settings.parse import build_config  # noqa: E402

YAML = os.path.join(ROOT, "config", "ViT.yaml")
MiB = 2**20


def held_gradient_bytes(model) -> tuple[int, int]:
    """(grads, unsharded): bytes of the gradients the optimizer will read (``.grad`` of the
    parameters: this rank's DTensor shards under FSDP) and of the unsharded gradients FSDP2
    holds for a later reduce-scatter (those it accumulates under
    ``set_requires_gradient_sync(False)``). FSDP2's parameters are read from its own state (its
    ``FSDPParam``s, not public API): while a module's weights are gathered, ``parameters()``
    yields the gathered tensors, not the shards that hold the gradients."""
    from torch.distributed.fsdp import FSDPModule

    from observe.memory import tensor_bytes

    grads, unsharded, managed = [], [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                grads.append(fp.sharded_param.grad)
                # in the reduce dtype when it differs from the parameters' (bf16 compute)
                unsharded.append(fp.unsharded_accumulated_grad)
                param = getattr(fp, "_unsharded_param", None)
                if param is not None:
                    managed.add(id(param))
                    unsharded.append(param.grad)
                managed.add(id(fp.sharded_param))
    grads += [p.grad for p in model.parameters() if id(p) not in managed]  # (not sharded)
    return (tensor_bytes(g for g in grads if g is not None),
            tensor_bytes(t for t in unsharded if t is not None))


def _measure_rank(overrides: dict, steps: int) -> dict:
    """One rank: a warm-up step, then ``steps`` timed steps; see the module docstring."""
    import contextlib
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.runtime import setup_runtime
    from engine.sharding import resharded
    from observe.memory import resident_peak_bytes, tensor_bytes
    from train import Trainer

    start_rss = _resident_bytes()
    cfg = build_config(YAML, "mp_cpu", overrides)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), \
            contextlib.redirect_stderr(quiet):
        trainer = Trainer(cfg, setup_runtime(cfg))
    model = trainer.model
    held = [0, 0]  # the most gradient bytes seen (grads + unsharded), as (grads, unsharded)
    timing = [False]

    def note(module, args):
        if timing[0]:
            grads, unsharded = held_gradient_bytes(model)
            if grads + unsharded > sum(held):
                held[:] = [grads, unsharded]

    for block in trainer.task.blocks(model):
        block.register_forward_pre_hook(note, prepend=True)  # before FSDP gathers the block
    trainer.loaders.train_sampler.set_epoch(0)
    model.train()
    batches = iter(trainer.loaders.train)
    times = []
    for i in range(steps + 1):
        x, y = trainer.to_device(*next(batches))
        timing[0] = i > 0
        t0 = time.perf_counter()
        loss, _ = trainer.train_step(x, y)
        float(loss)
        if i > 0:
            times.append(time.perf_counter() - t0)
    x, y = trainer.to_device(*next(batches))
    timing[0] = False
    resharded(model)  # (the root stays gathered after a forward pass)
    state = tensor_bytes(model.parameters()) + tensor_bytes(
        v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(x, y)
    return dict(sharded=held[0], unsharded=held[1], step_s=statistics.median(times),
                tensor_peak=state + allocation_peak(prof), vmhwm=resident_peak_bytes(),
                start_rss=start_rss)


def allocation_peak(prof) -> int:
    """The largest running sum of the allocations and frees a ``torch.profiler`` run with
    ``profile_memory`` recorded: the most bytes of tensors it held at once above its start."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()  # negative for a free
        peak = max(peak, now)
    return peak


def overrides(tmp: str, accum: int, reduce_each: bool, ranks: int) -> dict:
    return {"fsdp": "true", "fsdp_reduce_each_microbatch": str(reduce_each).lower(),
            "grad_accum_steps": str(accum), "global_batch_size": str(ranks * accum),
            "base_batch_size": str(ranks * accum), "data_loader_config": "synthetic",
            "limit_nsamples": "64", "limit_nsamples_val": "4", "num_data_workers": "0",
            "expdir": tmp, "num_iters": "100", "device": "cpu", "log_every": "1000"}


def main(argv=None):
    from settings.errors import OneLineParser, at_least, new_file
    from tests.distributed_harness import run_ranks

    ap = OneLineParser(prog="python -m benchmarks.fsdp_accumulation",
                       description="FSDP gradient accumulation: reduce-scatter per micro-batch vs "
                                   "once per step, on gloo ranks")
    ap.add_argument("--ranks", type=at_least(1), default=2, help="gloo ranks (default: %(default)s)")
    ap.add_argument("--grad_accum_steps", type=at_least(1), default=4,
                    help="micro-batches per step, of one sample each (default: %(default)s)")
    ap.add_argument("--steps", type=at_least(1), default=4, help="timed steps (default: %(default)s)")
    ap.add_argument("--json", type=new_file, default="",
                    help="also write the figures to this file (a new file)")
    args = ap.parse_args(argv)
    rows = []
    for reduce_each in (True, False):
        print(f"[fsdp_reduce_each_microbatch={str(reduce_each).lower()}] {args.ranks} ranks ...",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="fsdp-accum-") as tmp:
            ov = overrides(tmp, args.grad_accum_steps, reduce_each, args.ranks)
            ranks = run_ranks(_measure_rank, args.ranks, ov, args.steps, timeout=1800)
            p = predict_config(build_config(YAML, "mp_cpu", ov), args.ranks, "flash", "cpu")
        rows.append(dict(reduce_each_microbatch=reduce_each, ranks=ranks,
                         predicted=dict(grads=p.grads, unsharded=p.unsharded_grads,
                                        peak=p.peak)))
    print(f"\n### FSDP, mp_cpu ViT, {args.ranks} gloo ranks, grad_accum_steps "
          f"{args.grad_accum_steps}: per rank (max over ranks), MiB and seconds\n")
    print("| fsdp_reduce_each_microbatch | gradients held, measured / model | of which unsharded "
          "| peak of torch's tensors | resident peak growth (VmHWM) | step time (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        worst = max(r["ranks"], key=lambda x: x["sharded"] + x["unsharded"])
        pr = r["predicted"]
        print(f"| {str(r['reduce_each_microbatch']).lower()} "
              f"| {(worst['sharded'] + worst['unsharded']) / MiB:.1f} / "
              f"{(pr['unsharded'] or pr['grads']) / MiB:.1f} | {worst['unsharded'] / MiB:.1f} "
              f"| {max(x['tensor_peak'] for x in r['ranks']) / MiB:.0f} "
              f"| {max(x['vmhwm'] - x['start_rss'] for x in r['ranks']) / MiB:.0f} "
              f"| {max(x['step_s'] for x in r['ranks']):.2f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
