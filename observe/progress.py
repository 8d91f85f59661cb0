"""Progress you can watch inside an epoch: plain log lines (rank 0), fit for a Slurm output file.

A line comes at every log point (every ``log_every`` steps, where the training loss is read back
anyway) and, on long steps, at least every ``every_s`` seconds in between. Such a line shows the
loss of the latest log point and says which step that was (reading a new one would make every
rank wait, and only rank 0 prints); its learning rate is the current one, a host-side number:

    Epoch 2 step 40/125 (32%): 81.2 samples/s, train loss 0.4312, lr 9.81e-04, epoch ETA 1m05s
    Epoch 2 step 47/125 (37%): 80.9 samples/s, train loss 0.4312 (at step 40), lr 9.74e-04, ...

Samples/s counts the whole job's samples over the wall time since the epoch began, the one
definition the epoch's line uses too (there, after waiting for the device); between log points
on a GPU it is the host's view (the device may still be a few steps behind). Before the run's
first log point there is no loss to show, and the line shows none. The ETA goes by the steps
after the epoch's first (which may hold a compile, or the first batch after validation), once
there are any.

``DataWait`` measures how much of an epoch the step waited for its data: on a CPU the time spent
fetching batches, on a GPU the device's idle share between the steps' work.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

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
        self.loss_at = None  # (epoch, step in epoch) of the log point that read ``loss``
        self.lr = math.nan

    def start_epoch(self, epoch: int, step_in_epoch: int, last: int):
        """Before the epoch's first step (``step_in_epoch`` > 0 after a resume mid-epoch);
        ``last``: the step in the epoch this call of it will end at (the run may end before the
        epoch does)."""
        self.epoch, self.first, self.last = epoch, step_in_epoch, last
        self.t0 = self.last_line = self.clock()
        self.t1 = None  # when this epoch's first step ended

    def rate(self, step_in_epoch: int) -> float:
        """Samples/s of the job since ``start_epoch``."""
        elapsed = self.clock() - self.t0
        return (step_in_epoch - self.first) * self.global_batch / max(elapsed, 1e-9)

    def step(self, step_in_epoch: int, loss: float | None = None, lr: float | None = None):
        """After each step, with the learning rate of the next: a line when ``loss`` (a log
        point's) is given, or when ``every_s`` has passed since the last line."""
        now = self.clock()
        if step_in_epoch == self.first + 1:
            self.t1 = now
        if lr is not None:
            self.lr = lr
        if loss is not None:
            self.loss, self.loss_at = loss, (self.epoch, step_in_epoch)
        elif now - self.last_line < self.every_s:
            return
        self.last_line = now
        if self.enabled:
            log.info(self.line(step_in_epoch))

    def line(self, step_in_epoch: int) -> str:
        n = self.steps_per_epoch
        done = step_in_epoch - self.first
        elapsed = self.clock() - self.t0
        if done > 1 and self.t1 is not None:  # the pace after the first step
            eta = (self.clock() - self.t1) / (done - 1) * (self.last - step_in_epoch)
        else:
            eta = elapsed / done * (self.last - step_in_epoch) if done else math.nan
        loss = ""
        if math.isfinite(self.loss):
            epoch, at = self.loss_at
            if (epoch, at) != (self.epoch, step_in_epoch):  # an earlier log point's
                at = f"step {at}" if epoch == self.epoch else f"epoch {epoch + 1} step {at}"
                loss = f"train loss {self.loss:.4g} (at {at}), "
            else:
                loss = f"train loss {self.loss:.4g}, "
        if math.isfinite(self.lr):
            loss += f"lr {self.lr:.3g}, "
        return (f"Epoch {self.epoch + 1} step {step_in_epoch}/{n} ({100 * step_in_epoch // n}%): "
                f"{self.rate(step_in_epoch):.1f} samples/s, {loss}"
                f"epoch ETA {duration(eta) if done else '?'}")


class DataWait:
    """The share of an epoch the step waited for data, on a CPU: the time spent fetching batches
    (the host runs the step, so while it fetches nothing is computed)."""

    label = "fetching batches"

    def __init__(self, clock=time.monotonic):
        self.clock, self.waited = clock, 0.0

    @staticmethod
    def for_device(device: torch.device) -> "DataWait":
        return DeviceIdle() if device.type == "cuda" else DataWait()

    def start_epoch(self):
        self.waited = 0.0

    @contextlib.contextmanager
    def fetching(self):
        """Around the fetch of one batch."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.waited += self.clock() - t0

    def step_begins(self):
        pass

    def step_ends(self):
        pass

    def share(self, elapsed_s: float) -> float:
        """At the epoch's end (after the device finished): the waiting share of ``elapsed_s``."""
        return min(1.0, self.waited / max(elapsed_s, 1e-9))


class DeviceIdle(DataWait):
    """On a GPU: the device's idle share of the epoch. A pair of CUDA events brackets each
    step's device work (the batch's copy to the device included); the device is busy from the
    moment it reaches the first to the moment it reaches the second, and idle in between steps,
    when the host has not yet queued the next one: waiting for its batch, or for itself. The
    events are read at the epoch's end, after it waited for the device anyway, so no step
    waits for them."""

    label = "device idle"

    def __init__(self, event=lambda: torch.cuda.Event(enable_timing=True)):
        super().__init__()
        self.event, self.pairs, self.n = event, [], 0  # events are made once and reused

    def start_epoch(self):
        self.n = 0

    def fetching(self):
        return contextlib.nullcontext()

    def step_begins(self):
        if self.n == len(self.pairs):
            self.pairs.append((self.event(), self.event()))
        self.pairs[self.n][0].record()

    def step_ends(self):
        self.pairs[self.n][1].record()
        self.n += 1

    def share(self, elapsed_s: float) -> float:
        busy_s = sum(a.elapsed_time(b) for a, b in self.pairs[:self.n]) / 1e3  # ms -> s
        return min(1.0, max(0.0, 1.0 - busy_s / max(elapsed_s, 1e-9)))
