"""The IO / SYNTHETIC / FULL throughput report (``--throughput_report``, ``--enable_benchy``;
docs/performance.md, "IO / SYNTHETIC / FULL"): the trials' optimizer steps follow the final
checkpoint, which is read back afterwards."""
from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist

from engine.stop import RunStopped
from observe.logging_utils import EVERY_RANK_UP_TO, over_ranks
from observe.memory import NullProbe
from observe.profiling import nvtx_range

MODES = ("IO", "SYNTHETIC", "FULL")
ROUNDS = 3  # repetitions of each trial: the spread of the rounds is the reported std
WARMUP = 2  # untimed batches at the start of each round (worker start-up, allocator, caches)
MAX_TIMED = 20  # timed batches per round, at most
NOISY = 0.25  # a trial whose rounds' std exceeds this share of their mean supports no verdict

log = logging.getLogger(__name__)


def trial_sizes(steps_per_epoch: int, lag: int = 1) -> tuple[int, int]:
    """(warm-up, timed) batches per round, the window ending before the pass's last ``lag``
    fetches (docs/performance.md, "IO / SYNTHETIC / FULL"; a pass of ``lag`` or fewer: one)."""
    room = max(steps_per_epoch - lag, 1)
    warmup = min(WARMUP, room - 1)
    return warmup, min(MAX_TIMED, room - warmup)


def _loader_pass(tr, epoch: int):
    """A fresh pass of the training loader as epoch ``epoch``, fetched as in training (``stopper``)."""
    def stop(signum):  # on any rank: the report ends on all (the final checkpoint is written)
        raise RunStopped(signum, tr.iteration, tr.checkpointer.written_for(tr.iteration))

    tr.loaders.train_sampler.set_epoch(epoch, 0)
    yield from tr.stopper.batches(tr.loaders.train, "training (throughput report)", epoch, 0,
                                  stop=stop, first_recorded=True)


def measure(tr) -> dict[str, list[float]]:
    """This rank's samples/s in each round of each mode. Collective: every rank must call it."""
    warmup, timed = trial_sizes(tr.steps_per_epoch, tr.stopper.lag)
    first_epoch = tr.state.epoch + 1  # past the run's epochs: samples it has not used last
    tr.model.train()

    def step(x, y):
        tr.train_step(x, y, NullProbe())

    work = {"IO": tr.to_device, "SYNTHETIC": step, "FULL": lambda x, y: step(*tr.to_device(x, y))}
    sync = torch.cuda.synchronize if tr.device.type == "cuda" else lambda: None
    cached = tr.to_device(*next(_loader_pass(tr, first_epoch)))
    rates = {m: [] for m in MODES}
    for r in range(ROUNDS):
        for mode in MODES:
            batches = itertools.repeat(cached) if mode == "SYNTHETIC" else \
                _loader_pass(tr, first_epoch + r)
            with nvtx_range(f"throughput {mode}"):
                for _ in range(warmup):
                    work[mode](*next(batches))
                sync()
                tr.rt.barrier()  # collective: every rank starts its window together
                t0 = time.perf_counter()
                for _ in range(timed):
                    work[mode](*next(batches))
                sync()
                seconds = time.perf_counter() - t0
            rates[mode].append(tr.rt.local_batch * timed / max(seconds, 1e-9))
    return rates


def _mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def summarise(per_rank: list[dict], replica_ranks: int) -> dict[str, dict]:
    """Mean and std over rounds of all ranks' samples/s together (``per_rank``: their ``measure``);
    the ``replica_ranks`` of a model replica (tp x cp) share a batch, counted once."""
    return {m: _mean_std([sum(vals) / replica_ranks for vals in zip(*(r[m] for r in per_rank))])
            for m in MODES}


def bottleneck_line(io: float, synthetic: float, full: float, workers: int = 0,
                    std: dict | None = None) -> str:
    """The one-line reading (docs/performance.md, "IO / SYNTHETIC / FULL"): ``workers``, the
    run's num_data_workers; ``std``, each mode's (over ``NOISY`` of its mean: no verdict)."""
    noisy = [f"{m} {mean:.1f} +/- {std[m]:.1f}" for m, mean in zip(MODES, (io, synthetic, full))
             if std and std[m] > NOISY * mean]
    if noisy:
        return (f"Bottleneck: none named, the measurement is too noisy ({', '.join(noisy)} "
                f"samples/s): for a steadier one, time more batches (more steps per epoch: a round "
                f"times up to {MAX_TIMED}), use fewer threads "
                f"(OMP_NUM_THREADS, --num_data_workers) and an otherwise idle machine")
    if io >= synthetic:
        text = (f"the loader keeps up (IO {io:.1f} >= SYNTHETIC {synthetic:.1f} samples/s): "
                f"the model's step bounds FULL")
    else:
        text = (f"the loader is the bottleneck (IO {io:.1f} < SYNTHETIC {synthetic:.1f} "
                f"samples/s): more --num_data_workers or a DALI loader")
    share = full / min(io, synthetic)
    if share < 0.8:
        why = ("no loader workers: try --num_data_workers" if workers == 0 else
               f"{workers} loader worker{'s' if workers > 1 else ''} and the model share too few "
               f"cores, or too few workers")
        text += (f"; FULL is {share:.0%} of the slower one: loading is not hidden behind "
                 f"compute ({why})")
    return "Bottleneck: " + text


def _modes_text(stats: dict) -> str:
    return ", ".join(f"{m} {stats[m]['mean']:.1f} +/- {stats[m]['std']:.1f}" for m in MODES)


def rank_lines(entries: list[dict]) -> list[str]:
    """Each rank's line up to ``EVERY_RANK_UP_TO`` ranks, beyond one per trial: slowest, median, fastest."""
    if len(entries) <= EVERY_RANK_UP_TO:
        return [f"  rank {e['rank']}: {_modes_text(e)}" for e in entries]
    return [f"  {m} per rank (mean of the rounds): "
            f"{over_ranks([e[m]['mean'] for e in entries], '.1f')}" for m in MODES]


def run(tr) -> dict | None:
    """Measure on every rank and put the trainer's state back; rank 0 logs, writes and returns the
    report (``throughput.json``, TensorBoard scalars)."""
    rt = tr.rt
    warmup, timed = trial_sizes(tr.steps_per_epoch, tr.stopper.lag)
    log.info(f"Throughput report: IO, SYNTHETIC and FULL trials, {ROUNDS} rounds of {warmup} "
             f"warm-up + {timed} timed batches each (training state is put back afterwards)")
    if tr.steps_per_epoch <= tr.stopper.lag:
        log.warning(f"Throughput report: an epoch of {tr.steps_per_epoch} step(s) holds no batch "
                    f"fetched inside a timed window (batches are fetched {tr.stopper.lag} "
                    f"step(s) ahead): IO and FULL leave the loading out; train with more steps "
                    f"per epoch to time it")
    mine = measure(tr)
    tr.checkpointer.reload()  # the trials' steps leave no trace: the final checkpoint read back
    tr.loaders.train_sampler.set_epoch(tr.state.epoch, tr.state.step_in_epoch)
    per_rank = [mine]
    if rt.distributed:
        per_rank = [None] * rt.world_size
        dist.all_gather_object(per_rank, mine)  # collective, once: every rank's round rates
    if not rt.is_main:
        return None
    total = summarise(per_rank, rt.world_size // rt.dp_size)
    report = {
        "unit": "samples/s", "modes": list(MODES), "rounds": ROUNDS, "warmup_batches": warmup,
        "timed_batches": timed, "local_batch_size": rt.local_batch,
        "global_batch_size": rt.global_batch, "world_size": rt.world_size,
        "data_parallel": rt.dp_size, "device": str(tr.device),
        "data_loader_config": tr.cfg.data_loader_config,
        "num_data_workers": tr.cfg.num_data_workers, "iteration": tr.iteration,
        "aggregate": total,
        "per_rank": [{"rank": i, **{m: dict(_mean_std(r[m]), rounds=r[m]) for m in MODES}}
                     for i, r in enumerate(per_rank)],
        "bottleneck": bottleneck_line(*(total[m]["mean"] for m in MODES),
                                      workers=tr.cfg.num_data_workers,
                                      std={m: total[m]["std"] for m in MODES}),
    }
    who = f"all {rt.world_size} ranks, " if rt.distributed else ""
    log.info(f"Throughput ({who}samples/s, mean +/- std of {ROUNDS} rounds of {timed} batches): "
             f"{_modes_text(total)}")
    if rt.distributed:
        for line in rank_lines(report["per_rank"]):
            log.info(line)
    log.info(report["bottleneck"])
    path = os.path.join(tr.run_dir, "throughput.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    log.info(f"Throughput report written: {path}")
    tr.run_log.points({f"Throughput/{m}": total[m]["mean"] for m in MODES}, tr.iteration)
    return report
