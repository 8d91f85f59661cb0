"""The ranks' stop agreement, per training step: blocking after each fetch (as the engine did
before) against launched after the fetch and read a step later (``engine.stop_agreement``).

    python -m benchmarks.stop_agreement                 # 2, 4 and 8 gloo ranks, ~3 min on 2 cores
    python -m benchmarks.stop_agreement --ranks 2,4 --rounds 3

Each point is N gloo ranks on this machine (one thread each) training the ViT quickstart, cut
to one block of width 32, on files (``lowmem``, no worker processes: a loader that may wait, so
the ranks propose after every fetch) at a local batch of 1: a step of milliseconds, where an
agreement's cost shows.
Each rank trains one epoch to warm up, then ``--rounds`` epochs alternating the two ways; a
way's figure is the median over its epochs of the steady-state step time (the epoch's wall time
from the end of its first step, over its steps: rank 0's, the ranks step together). Both ways
run in the same processes, so they compare; the CPU figures say nothing of a GPU cluster's
absolute times (docs/parallelism.md gives the model for 256 and 1024 ranks).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, world: int, port: int, data_root: str, expdir: str, rounds: int, queue):
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

        def after_fetch(self, *args, **kwargs):
            super().after_fetch(*args, **kwargs)
            self._pending = self.decision()

    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", dict(
        data_root=data_root, expdir=expdir, num_data_workers="0", global_batch_size=str(world),
        base_batch_size=str(world), num_epochs="100", log_every="1000", checkpoint_every="0",
        limit_nsamples=str(60 * world),  # 60 steps an epoch
        embed_dim="32", depth="1", num_heads="2"))  # a step of milliseconds
    if rank:
        logging.disable(logging.INFO)
    tr = Trainer(cfg, setup_runtime(cfg), stop_request=StopRequest())
    ways = {"after": tr.agreement,
            "before": Blocking(tr.stop_request, True, tr.rt.host_group, every=cfg.log_every)}
    times = {w: [] for w in ways}
    try:
        for epoch in range(1 + 2 * rounds):
            way = "after" if epoch % 2 else "before"
            tr.agreement = ways[way]
            stats = tr.train_epoch()
            tr.state.next_epoch()
            if epoch:
                times[way].append(tr.rt.global_batch / stats.steady_samples_per_s)
    finally:
        tr.loaders.close()
    if rank == 0:
        queue.put({w: statistics.median(t) for w, t in times.items()})
    tr.rt.barrier()  # every rank done before any tears the group down
    tr.rt.shutdown()


def measure(world: int, rounds: int, data_root: str, base: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, port, data_root, os.path.join(base, f"ws{world}"),
                                    rounds, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="epochs of each way per point")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as base:
        data_root = os.path.join(base, "data")  # the quickstart's synthetic files, made once
        rows = []
        for world in map(int, args.ranks.split(",")):
            t = measure(world, args.rounds, data_root, base)
            rows.append((world, t["before"] * 1e3, t["after"] * 1e3))
            print(f"{world} ranks: before {rows[-1][1]:.2f} ms, after {rows[-1][2]:.2f} ms per "
                  f"step", flush=True)
    print("\n| ranks | step, agreement blocking after each fetch (ms) | step, agreement read a "
          "step later (ms) | before / after |\n|---|---|---|---|")
    for world, before, after in rows:
        print(f"| {world} | {before:.2f} | {after:.2f} | {before / after:.3f} |")


if __name__ == "__main__":
    main()
