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

``--exchange``: one agreement's own time, gloo's ring all-reduce against the rounds the engine
uses from 64 ranks (``engine.stop_agreement.Rounds``) and against the same rounds with each
round's receive posted in its round, each call launched and waited for back to back on N ranks
doing nothing else, the ways alternating in blocks of 8 calls, median over 48 each.
``--write-delay-us D`` delays every socket write of the ranks by D us (a small shared library
built with the C compiler and preloaded), so that the messages' latency outweighs the CPU time,
as over a network of hundreds of ranks and unlike loopback on a few cores:

    python -m benchmarks.stop_agreement --exchange --ranks 8,16,32 --write-delay-us 2000
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile

import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from settings.errors import OneLineParser, at_least, counts, refuse  # noqa: E402


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
    ways = {"before": other(tr.stop_request, True, tr.rt.agreement_group, every=cfg.log_every),
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, rounds: int, data_root: str, base: str, ring_s: float = 0.0) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), data_root, os.path.join(base, f"ws{world}"),
                                    rounds, queue, ring_s), nprocs=world, start_method="spawn")
    return queue.get()


# Every writev (gloo's TCP transport sends with it) delayed WRITE_DELAY_US microseconds.
WRITE_DELAY_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>
ssize_t writev(int fd, const struct iovec *iov, int n) {
  static ssize_t (*real)(int, const struct iovec *, int);
  static long ns = -1;
  if (!real) real = (ssize_t (*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
  if (ns < 0) { const char *us = getenv("WRITE_DELAY_US"); ns = us ? atol(us) * 1000L : 0; }
  if (ns > 0) { struct timespec t = {ns / 1000000000L, ns % 1000000000L}; nanosleep(&t, 0); }
  return real(fd, iov, n);
}
"""


def write_delay_library(directory: str) -> str:
    """Build the preloaded library that delays every socket write; its path."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        refuse("--write-delay-us needs a C compiler (cc or gcc) to build its preloaded library: "
               "install one (Debian: apt install gcc), or leave --write-delay-us out")
    source, library = os.path.join(directory, "write_delay.c"), os.path.join(directory,
                                                                              "write_delay.so")
    with open(source, "w") as f:
        f.write(WRITE_DELAY_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", library, source, "-ldl"],
                   check=True)
    return library


def _exchange_rank(rank: int, world: int, port: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    sys.path.insert(0, ROOT)
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from engine.runtime import new_host_group
    from engine.stop_agreement import Rounds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    group = new_host_group(datetime.timedelta(seconds=300))

    class InTurn(Rounds):
        """Each round's receive posted in its round (not all at the start)."""

        def _rounds(self, held, lane, in_turn=False):
            return super()._rounds(held, lane, in_turn=True)

    # (their calls never overlap: each is waited for before the next, so their tags may match)
    rounds, in_turn = Rounds(group), InTurn(group)

    def ring(t):
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)

    ways = {"ring": ring, "in_turn": in_turn.max, "rounds": rounds.max}
    times = {w: [] for w in ways}
    for block in range(7):  # the first: connections made, caches warm (not timed)
        for way, launch in ways.items():
            for _ in range(8):
                t0 = time.perf_counter()
                launch(torch.zeros(2, dtype=torch.int32)).wait()
                if block:
                    times[way].append(time.perf_counter() - t0)
    rounds.close()
    in_turn.close()
    if rank == 0:
        queue.put({w: statistics.median(t) for w, t in times.items()} | {
            "messages": len(rounds.peers)})
    dist.barrier()
    dist.destroy_process_group()


def measure_exchange(world: int, delay_us: int, library: str | None) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    before = {k: os.environ.get(k) for k in ("LD_PRELOAD", "WRITE_DELAY_US")}
    if library:  # the ranks' processes start with it: spawn passes the environment on
        os.environ.update(LD_PRELOAD=library, WRITE_DELAY_US=str(delay_us))
    try:
        mp.start_processes(_exchange_rank, args=(world, _free_port(), queue), nprocs=world,
                           start_method="spawn")
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
    return queue.get()


def exchange(ranks: list[int], delay_us: int):
    with tempfile.TemporaryDirectory() as base:
        library = write_delay_library(base) if delay_us else None
        rows = []
        for world in ranks:
            t = measure_exchange(world, delay_us, library)
            rows.append((world, t["messages"], *(t[w] * 1e3 for w in ("ring", "in_turn",
                                                                        "rounds"))))
            print(f"{world} ranks: ring {rows[-1][2]:.2f} ms, {t['messages']} rounds "
                  f"{rows[-1][4]:.2f} ms ({rows[-1][3]:.2f} with each receive in its round) per "
                  f"agreement", flush=True)
    print("\n| ranks | socket writes delayed | ring: messages in a row | rounds | agreement, "
          "ring (ms) | rounds, each receive in its round (ms) | rounds (ms) | ring / rounds | "
          "in its round / at the start |\n|---|---|---|---|---|---|---|---|---|")
    for world, n, ring, in_turn, rounds in rows:
        print(f"| {world} | {delay_us} us | {2 * (world - 1)} | {n} | {ring:.2f} | "
              f"{in_turn:.2f} | {rounds:.2f} | {ring / rounds:.2f} | {in_turn / rounds:.2f} |")


def main(argv=None):
    parser = OneLineParser(prog="python -m benchmarks.stop_agreement",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=counts(2, "2,4,8", " ranks have no peers to agree with"),
                        default=[2, 4, 8],
                        help="rank counts, comma-separated, each 2 or more (default: 2,4,8)")
    parser.add_argument("--rounds", type=at_least(1), default=5,
                        help="epochs of each way per point")
    parser.add_argument("--ring-ms", type=at_least(0.0, float), default=0.0,
                        help="simulate a ring this long: lag 1 against the lag the ranks choose")
    parser.add_argument("--exchange", action="store_true",
                        help="one agreement's time: gloo's ring against the rounds")
    parser.add_argument("--write-delay-us", type=at_least(0), default=0,
                        help="with --exchange: delay every socket write this long")
    args = parser.parse_args(argv)
    if args.exchange:
        return exchange(args.ranks, args.write_delay_us)
    with tempfile.TemporaryDirectory() as base:
        data_root = os.path.join(base, "data")  # the quickstart's synthetic files, made once
        rows = []
        for world in args.ranks:
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
