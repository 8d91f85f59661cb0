"""The ranks' stop agreement per training step: N gloo ranks train with it (``engine.stop``: an
all-reduce launched after each fetch, read before the batch's step) and without it.

    python -m benchmarks.stop_agreement                 # 2, 4 and 8 gloo ranks, ~3 min on 2 cores
    python -m benchmarks.stop_agreement --ranks 2,4 --ring-ms 40   # a ring of 40 ms

A warm-up epoch, then ``--rounds`` epochs of each way alternating in the same processes; a way's
figure is the median of rank 0's steady-state step times, the agreement's own its calls' time
per step on rank 0. The model trained and the figures: docs/preemption.md, docs/parallelism.md.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time

import torch.multiprocessing as mp

from settings.errors import OneLineParser, at_least, counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def simulate_long_ring(ring_s: float):
    """From now on in this process, every all-reduce launched without waiting holds one of 2
    threads for ``ring_s`` from when a thread takes it up (or until it is done, if later), as
    gloo's 2 threads per group are held for a ring of hundreds of ranks (launched in order: the
    ranks' collectives still match). For the tests of the lag the ranks choose."""
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
          ring_s: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import logging

    import torch

    torch.set_num_threads(1)
    from engine.runtime import setup_runtime
    from engine.stop import RunEnding, Stopper, StopRequest
    from settings.parse import build_config
    from train import Trainer

    class Timed(Stopper):
        """The stopper, its agreement's calls timed."""
        spent = 0.0

        def after_fetch(self, *args, **kwargs):
            t0 = time.perf_counter()
            super().after_fetch(*args, **kwargs)
            self.spent += time.perf_counter() - t0

        def decision(self, *args, **kwargs):
            t0 = time.perf_counter()
            signum = super().decision(*args, **kwargs)
            self.spent += time.perf_counter() - t0
            return signum

    if ring_s:
        simulate_long_ring(ring_s)
    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", dict(
        data_root=data_root, expdir=expdir, num_data_workers="0", global_batch_size=str(world),
        base_batch_size=str(world), num_epochs="100", log_every="1000", checkpoint_every="0",
        limit_nsamples=str(60 * world),  # 60 steps an epoch
        embed_dim="32", depth="1", num_heads="2"))  # a step of milliseconds
    if rank:
        logging.disable(logging.INFO)
    tr = Trainer(cfg, setup_runtime(cfg), RunEnding(cfg, StopRequest()))
    tr.stopper.close()
    ways = {w: Timed(tr.stopper.request, w == "with", tr.rt.host_group, cfg.log_every,
                     cfg.loader_timeout_s) for w in ("with", "without")}
    times = {w: [] for w in ways}
    spent = []
    try:
        for epoch in range(1 + 2 * rounds):  # the first: the warm-up, with the agreement
            way = "without" if epoch % 2 else "with"
            stopper = tr.stopper = ways[way]
            stopper.spent = 0.0
            stats = tr.train_epoch()
            tr.state.next_epoch()
            stopper.now()  # as after a validation
            if epoch:
                times[way].append(tr.rt.global_batch / stats.steady_samples_per_s)
                if way == "with":
                    spent.append(stopper.spent / stats.steps)
    finally:
        tr.loaders.close()
        for stopper in ways.values():
            stopper.close()
    if rank == 0:
        queue.put({w: statistics.median(t) for w, t in times.items()} | {
            "spent": statistics.median(spent), "lag": ways["with"].lag})
    tr.rt.barrier()  # every rank done before any tears the group down
    tr.rt.shutdown()


def measure(world: int, rounds: int, data_root: str, base: str, ring_s: float = 0.0) -> dict:
    with socket.socket() as s:  # a free port for the ranks' group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(world, port, data_root,
                                    os.path.join(base, f"ws{world}"), rounds, queue, ring_s),
                       nprocs=world, start_method="spawn")
    return queue.get()


def main(argv=None):
    parser = OneLineParser(prog="python -m benchmarks.stop_agreement",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=counts(2, "2,4,8", " ranks have no peers to agree with"),
                        default=[2, 4, 8],
                        help="rank counts, comma-separated, each 2 or more (default: 2,4,8)")
    parser.add_argument("--rounds", type=at_least(1), default=3,
                        help="epochs of each way per point")
    parser.add_argument("--ring-ms", type=at_least(0.0, float), default=0.0,
                        help="simulate a ring this long (the lag the ranks choose hides it)")
    args = parser.parse_args(argv)
    print("| ranks | step without the agreement (ms) | step with it (ms) | its calls per step "
          "(ms) | lag |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as base:
        data_root = os.path.join(base, "data")  # the quickstart's synthetic files, made once
        for world in args.ranks:
            t = measure(world, args.rounds, data_root, base, args.ring_ms / 1e3)
            print(f"| {world} | {t['without'] * 1e3:.2f} | {t['with'] * 1e3:.2f} | "
                  f"{t['spent'] * 1e3:.3f} | {t['lag']} |", flush=True)


if __name__ == "__main__":
    main()
