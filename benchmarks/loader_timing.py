"""Timing a loader's batches, the same way for this tree's loaders and for an older
revision's served from a child process (``serve``, used by benchmarks/throughput.py). Imports
nothing of the project at module level, so that the child takes the older revision's."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import torch


def batches(loader, epoch=0):
    """Batches without end: epoch after epoch, from ``epoch``."""
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def measure(loader, n_batches, warmup, epoch, ahead):
    """One measurement of ``loader``: samples/s (``rate``), GB/s delivered (``gbs``) and the
    main process's CPU ms per batch (``cpu_ms``) over ``n_batches`` batches of a pass started at
    ``epoch``, after ``warmup`` batches (the prefetch queue's); then waits while the ``ahead``
    batches prefetched meanwhile are read (at the measured rate), so that they do not run beside
    the next measurement."""
    it = batches(loader, epoch)
    for _ in range(warmup):
        next(it)
    n = nbytes = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n_batches):
        x, y = next(it)
        n += x.shape[0]
        nbytes += x.nbytes + y.nbytes
        del x, y  # as the training loop: nothing holds the batch while the next one is fetched
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    it.close()
    time.sleep(min(3.0, ahead * dt / n_batches))
    return {"rate": n / dt, "gbs": nbytes / dt / 1e9, "cpu_ms": 1e3 * cpu / n_batches}


def close_loaders(loaders):
    """End the loaders' workers; returns None, to drop the last reference with."""
    close = getattr(loaders, "close", None)
    if callable(close):
        close()
    gc.collect()



def serve(tree: str, threads: int):
    """The child process of ``OldLoaders`` in benchmarks/throughput.py: the loaders of ``tree``,
    an older revision's ``utils`` (before the data path moved to ``datapipe``); one JSON command
    per line on stdin, one JSON reply per line on the original stdout (anything the loaders print
    goes to stderr)."""
    sys.path.insert(0, tree)
    import utils  # that revision's package, and its module names:
    from utils.config import build_config
    from utils.data_loader import build_loaders

    here = os.path.realpath(os.path.dirname(utils.__file__))
    if not here.startswith(os.path.realpath(tree)):
        raise SystemExit(f"utils imported from {here}, not from {tree}")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.set_num_threads(threads)
    loaders = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "build":
                loaders = close_loaders(loaders)
                cfg = build_config(cmd["yaml"], cmd["config"], cmd["overrides"])
                loaders = build_loaders(cfg, 1, 0, cfg.global_batch_size, torch.device("cpu"))
                reply = {}
            else:
                reply = measure(loaders.train, cmd["batches"], cmd["warmup"], cmd["epoch"],
                                cmd["ahead"])
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
            traceback.print_exc()  # to stderr, the parent's
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
    close_loaders(loaders)
