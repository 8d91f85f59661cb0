"""Progress you can watch inside an epoch: plain log lines (rank 0), fit for a Slurm output file.

A line comes at every log point (every ``log_every`` steps, where the training loss is read back
anyway) and, on long steps, at least every ``every_s`` seconds in between (then with the loss of
the latest log point: reading a new one would make every rank wait, and only rank 0 prints):

    Epoch 2 step 40/125 (32%): 81.2 samples/s, train loss 0.4312, lr 9.81e-04, epoch ETA 1m05s

Samples/s counts the whole job's samples since the epoch's first step; between log points on a
GPU it is the host's view (the device may still be a few steps behind).
"""
from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("train")


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    def __init__(self, steps_per_epoch: int, global_batch: int, enabled: bool,
                 every_s: float = 30.0, clock=time.monotonic):
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch
        self.enabled, self.every_s, self.clock = enabled, every_s, clock
        self.loss = math.nan
        self.lr = math.nan

    def start_epoch(self, epoch: int, step_in_epoch: int, last: int):
        """Before the epoch's first step (``step_in_epoch`` > 0 after a resume mid-epoch);
        ``last``: the step in the epoch this call of it will end at (the run may end before the
        epoch does)."""
        self.epoch, self.first, self.last = epoch, step_in_epoch, last
        self.t0 = self.last_line = self.clock()

    def rate(self, step_in_epoch: int) -> float:
        """Samples/s of the job since ``start_epoch``."""
        elapsed = self.clock() - self.t0
        return (step_in_epoch - self.first) * self.global_batch / max(elapsed, 1e-9)

    def step(self, step_in_epoch: int, loss: float | None = None, lr: float | None = None):
        """After each step: a line when ``loss`` (a log point's) is given, or when ``every_s``
        has passed since the last line."""
        now = self.clock()
        if loss is not None:
            self.loss, self.lr = loss, lr
        elif now - self.last_line < self.every_s:
            return
        self.last_line = now
        if self.enabled:
            log.info(self.line(step_in_epoch))

    def line(self, step_in_epoch: int) -> str:
        n = self.steps_per_epoch
        done = step_in_epoch - self.first
        elapsed = self.clock() - self.t0
        eta = elapsed / done * (self.last - step_in_epoch) if done else math.nan
        return (f"Epoch {self.epoch + 1} step {step_in_epoch}/{n} ({100 * step_in_epoch // n}%): "
                f"{self.rate(step_in_epoch):.1f} samples/s, train loss {self.loss:.4g}, "
                f"lr {self.lr:.3g}, epoch ETA {duration(eta) if done else '?'}")
