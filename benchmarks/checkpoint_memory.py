"""Memory of saving a checkpoint under FSDP x tensor parallelism, per rank, against the step's.

    python -m benchmarks.checkpoint_memory                 # 4 gloo ranks: dp 2 x tp 2, ~1 min
    python -m benchmarks.checkpoint_memory --embed_dim 512 --depth 8

Each of 4 gloo ranks (one thread each) builds the ViT of the ``mp_cpu`` config at the given
size under ``--fsdp`` with ``tensor_parallel 2`` (dp = 2), takes 2 training steps, then writes
a checkpoint in two ways: as the engine does it (each tensor put together over dp and tp alone,
copied to rank 0's host memory, dropped at once on the other ranks), and as it was done before
(every rank gathering every tensor of the weights and both Adam moments at once, and holding
them all until the write ends). A thread samples the process's resident memory every
millisecond; the figures are the peaks above the memory held before the model was built (the
libraries), in MB: during the training steps and during each save.

On a CPU the host is the device: rank 0's save peak includes the serial state it writes (on a
GPU that copy is in host memory, and its device holds at most one whole tensor beyond its
shards, as the other ranks' do here).
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time

import torch.multiprocessing as mp

from benchmarks.mp_memory import _resident_bytes
from settings.errors import ConfigError, OneLineParser, at_least, refuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Peak:
    """The highest resident memory seen since ``reset``, sampled by a thread."""

    def __init__(self):
        self.peak, self._stop = 0, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _resident_bytes())
            time.sleep(0.001)

    def reset(self) -> int:
        time.sleep(0.01)
        peak, self.peak = self.peak, _resident_bytes()
        return peak


def config(args, out: str):
    """The ``mp_cpu`` config each rank trains, at the given size."""
    from settings.parse import build_config

    return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "mp_cpu", dict(
        expdir=out, data_root=os.path.join(out, "data"), fsdp="true", tensor_parallel="2",
        embed_dim=str(args.embed_dim), depth=str(args.depth), num_iters="2",
        data_loader_config="synthetic", checkpoint_every="0", global_batch_size="2",
        base_batch_size="2", log_every="1"))


def _rank(rank, world, port, out, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    sys.path.insert(0, ROOT)
    import logging

    import torch
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    from engine.runtime import setup_runtime
    from train import Trainer

    logging.disable(logging.INFO)
    base = _resident_bytes()
    peak = Peak()
    cfg = config(args, out)
    tr = Trainer(cfg, setup_runtime(cfg))
    peak.reset()
    tr.train_epoch()
    train_peak = peak.reset()
    tr.save_checkpoint()
    save_peak = peak.reset()
    sharding = tr.sharding

    def gathered_everywhere(model, tensors, keep=True):  # as before: all at once, on all ranks
        whole = {k: t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
                 for k, t in tensors.items()}
        return sharding.inner.to_serial(model, whole)

    sharding.to_serial = gathered_everywhere  # (keep ignored: every rank holds everything)
    tr.save_checkpoint()
    before_peak = peak.reset()
    tr.loaders.close()
    params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                 for p in tr.model.parameters())  # this rank's shards
    queue.put((rank, params, (train_peak - base) / 1e6, (save_peak - base) / 1e6,
               (before_peak - base) / 1e6))


def main(argv=None):
    parser = OneLineParser(prog="python -m benchmarks.checkpoint_memory",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed_dim", type=at_least(1), default=512, help="the ViT's width")
    parser.add_argument("--depth", type=at_least(1), default=8, help="the ViT's blocks")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:  # the ranks' config, checked before they start
        try:
            config(args, out)
        except ConfigError as e:
            refuse(f"--embed_dim {args.embed_dim} --depth {args.depth} (the mp_cpu config): {e}")
    world = 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, port, out, args, queue), nprocs=world,
                           start_method="spawn")
        rows = sorted(queue.get() for _ in range(world))
    print(f"ViT mp_cpu, embed {args.embed_dim}, depth {args.depth}; FSDP over dp 2 x tp 2 (4 "
          f"gloo ranks). Resident memory above the libraries', MB:\n")
    print("| rank | parameters held | training steps | save (tensor by tensor, rank 0 keeps) | "
          "save / training | save as before (all gathered on every rank) | before / training |"
          "\n|---|---|---|---|---|---|---|")
    for rank, params, train, save, before in rows:
        print(f"| {rank} | {params / 1e6:.2f} M | {train:.0f} | {save:.0f} | {save / train:.2f} "
              f"| {before:.0f} | {before / train:.2f} |")


if __name__ == "__main__":
    main()
