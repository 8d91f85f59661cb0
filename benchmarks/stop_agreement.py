"""The ranks' stop agreement, per training step: blocking after each fetch (as the engine did
before) against launched after the fetch and read before its step (``engine.stop_agreement``);
with ``--ring-ms``, a ring longer than a step: batches fetched one step ahead against the lag the
ranks choose.

    python -m benchmarks.stop_agreement                 # 2, 4 and 8 gloo ranks, ~3 min on 2 cores
    python -m benchmarks.stop_agreement --ranks 2,4 --rounds 3
    python -m benchmarks.stop_agreement --ranks 4 --ring-ms 60   # a ring of 60 ms

Each point is N gloo ranks on this machine (one thread each) training the ViT quickstart, cut
to one block of width 32, on files (``lowmem``, no worker processes: a loader that may wait, so
the ranks propose after every fetch) at a local batch of 1: a step of milliseconds, where an
agreement's cost shows.
Each rank trains one epoch to warm up, then ``--rounds`` epochs alternating the two ways; a
way's figure is the median over its epochs of the steady-state step time (the epoch's wall time
from the end of its first step, over its steps: rank 0's, the ranks step together). Both ways
run in the same processes, so they compare; the CPU figures say nothing of a GPU cluster's
absolute times (docs/parallelism.md gives the model for 256 and 1024 ranks).

``--ring-ms``: every all-reduce launched without waiting holds one of 2 threads that long (a
ring of hundreds of ranks simulated on a few: gloo runs a group's collectives on 2 threads, each
held for the whole ring). The ways are then the engine's with
its lag held at 1 and the engine's as it is, which after each epoch takes part in the blocking
agreement a validation makes (where the ranks choose the lag); the warm-up epoch is the
latter's, so that its lag is chosen before the timed epochs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def simulate_long_ring(ring_s: float):
    """From now on in this process, every all-reduce launched without waiting holds one of 2
    threads for ``ring_s`` from when a thread takes it up (or until it is done, if later), as
    gloo's 2 threads per group are held for a ring of hundreds of ranks (launched in order: the
    ranks' collectives still match)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    real, threads = dist.all_reduce, ThreadPoolExecutor(2)

    def held(tensor, *args, async_op=False, **kwargs):
        work = real(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        def ring():
            until = time.perf_counter() + ring_s
            work.wait()
            time.sleep(max(0.0, until - time.perf_counter()))

        done = threads.submit(ring)

        class Held:
            def wait(self):
                done.result()
                return True

        return Held()

    dist.all_reduce = held


def _rank(rank: int, world: int, port: int, data_root: str, expdir: str, rounds: int, queue,
          ring_s: float = 0.0):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    sys.path.insert(0, ROOT)
    import logging

    import torch

    torch.set_num_threads(1)
    from engine.preemption import StopRequest
    from engine.runtime import setup_runtime
    from engine.stop_agreement import StopAgreement
    from settings.parse import build_config
    from train import Trainer

    class Blocking(StopAgreement):
        """The agreement as it was: an all-reduce waited for after each fetch."""

        def propose(self, *args, **kwargs):
            super().propose(*args, **kwargs)
            self._pending[-1][1][0].wait()  # (its decision then finds it done)

    class Pinned(StopAgreement):
        """The engine's agreement with its lag held at 1: it never asks for more."""

        def now(self, *args, **kwargs):
            self._needed.clear()
            return super().now(*args, **kwargs)

    if ring_s:
        simulate_long_ring(ring_s)

    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", dict(
        data_root=data_root, expdir=expdir, num_data_workers="0", global_batch_size=str(world),
        base_batch_size=str(world), num_epochs="100", log_every="1000", checkpoint_every="0",
        limit_nsamples=str(60 * world),  # 60 steps an epoch
        embed_dim="32", depth="1", num_heads="2"))  # a step of milliseconds
    if rank:
        logging.disable(logging.INFO)
    tr = Trainer(cfg, setup_runtime(cfg), stop_request=StopRequest())
    other = Pinned if ring_s else Blocking
    ways = {"before": other(tr.stop_request, True, tr.rt.host_group, every=cfg.log_every),
            "after": tr.agreement}
    times = {w: [] for w in ways}
    try:
        for epoch in range(1 + 2 * rounds):
            # the warm-up epoch: with a ring, the engine's (whose lag is chosen after it)
            way = "after" if (epoch % 2 if epoch else ring_s) else "before"
            tr.agreement = ways[way]
            stats = tr.train_epoch()
            tr.state.next_epoch()
            tr.agreement.now()  # as after a validation
            if epoch:
                times[way].append(tr.rt.global_batch / stats.steady_samples_per_s)
    finally:
        tr.loaders.close()
    if rank == 0:
        medians = {w: statistics.median(t) for w, t in times.items()}
        queue.put(medians | {"lag": ways["after"].lag})
    tr.rt.barrier()  # every rank done before any tears the group down
    tr.rt.shutdown()


def measure(world: int, rounds: int, data_root: str, base: str, ring_s: float = 0.0) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, port, data_root, os.path.join(base, f"ws{world}"),
                                    rounds, queue, ring_s), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="epochs of each way per point")
    parser.add_argument("--ring-ms", type=float, default=0.0,
                        help="simulate a ring this long: lag 1 against the lag the ranks choose")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as base:
        data_root = os.path.join(base, "data")  # the quickstart's synthetic files, made once
        rows = []
        for world in map(int, args.ranks.split(",")):
            t = measure(world, args.rounds, data_root, base, args.ring_ms / 1e3)
            rows.append((world, t["before"] * 1e3, t["after"] * 1e3, t["lag"]))
            print(f"{world} ranks: before {rows[-1][1]:.2f} ms, after {rows[-1][2]:.2f} ms per "
                  f"step (lag {t['lag']})", flush=True)
    if args.ring_ms:
        print("\n| ranks | ring (simulated) | step, batches fetched 1 step ahead (ms) | step, "
              "at the lag the ranks chose (ms) | lag | before / after |\n|---|---|---|---|---|---|")
        for world, before, after, lag in rows:
            print(f"| {world} | {args.ring_ms:g} ms | {before:.2f} | {after:.2f} | {lag} | "
                  f"{before / after:.3f} |")
        return
    print("\n| ranks | step, agreement blocking after each fetch (ms) | step, agreement read "
          "before its step (ms) | before / after |\n|---|---|---|---|")
    for world, before, after, _ in rows:
        print(f"| {world} | {before:.2f} | {after:.2f} | {before / after:.3f} |")


if __name__ == "__main__":
    main()
