"""The run log: everything a run shows, owned by one object that the training loop calls.

- Inside an epoch: the progress lines (``progress.py``) and, at each log point (every
  ``log_every`` steps), the training loss and gradient norm of the steps since the last one in
  TensorBoard. The losses are summed on the device; the host reads them only at log points and
  at the epoch's end.
- After the run's first step, how long the start took (``startup.py``); after each epoch's first
  step, every rank's memory (``memory.py``).
- After an epoch's validation, its lines: time and samples/s, the share it waited for data,
  TFLOP/s and MFU (``flops.py``), the training loss, the validation loss beside the naive
  baseline's and the task's metrics; the task's skill lines where it scores one.
- At the end, the summary lines.
- TensorBoard (rank 0, ``tensorboard.py``) and the profilers' windows (``profiling.py``).

The loop calls ``start_epoch``; around each step ``step_begins``, ``step_ends`` and
``step_done``; then ``end_epoch`` (its EpochStats), ``epoch``, ``skill``, ``summary`` and
``close``.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.lr_schedule import lr_at
from engine.runtime import Runtime
from observe.flops import peak_tflops, tflops_per_device
from observe.logging_utils import over_ranks
from observe.memory import GiB, NullProbe, resident_peak_bytes
from observe.profiling import ProfilerWindow, TraceWindow
from observe.progress import DataWait, Progress
from observe.startup import StartClock
from observe.tensorboard import Board, NullBoard
from settings.config import Config, to_dict
from settings.errors import TrainingError

log = logging.getLogger("train")


@dataclass
class EpochStats:
    """What one epoch's steps measured (``RunLog.end_epoch``)."""

    avg_loss: float  # mean training loss of the epoch's steps, over all data-parallel ranks
    elapsed_s: float  # wall time of the epoch, from before its first batch to its last step's end
    steps: int  # steps this call ran (fewer than an epoch after a resume mid-epoch)
    samples_per_s: float  # the job's samples over elapsed_s: what the epoch really delivered
    steady_samples_per_s: float | None = None  # from the end of the first step on (> 1 step)
    data_wait: float | None = None  # share of elapsed_s the step waited for data (DataWait)
    checkpoint_s: float = 0.0  # of elapsed_s, the time spent writing checkpoints mid-epoch


class RunLog:
    def __init__(self, cfg: Config, rt: Runtime, task, *, run_dir: str, start_clock: StartClock,
                 probe, steps_per_epoch: int, total_steps: int, iteration: int, peak_lr: float,
                 resumed: bool, finished: bool, derived: dict, kept_checkpoints):
        """``start_clock``: the set-up's parts so far (the first step ends the start); ``probe``:
        the memory probe of each epoch's first step; ``iteration``: the step the launch starts
        at; ``finished``: a resumed run with nothing left to do (it writes no TensorBoard events);
        ``derived``: the values the config implies, shown beside it in TensorBoard;
        ``kept_checkpoints()``: what a run that ends on a bad loss leaves to resume from."""
        self.cfg, self.rt, self.task, self.device = cfg, rt, task, rt.device
        self.run_dir, self.start_clock, self.probe = run_dir, start_clock, probe
        self.steps_per_epoch, self.total_steps, self.peak_lr = steps_per_epoch, total_steps, peak_lr
        self.kept_checkpoints = kept_checkpoints
        self.flops_per_sample = task.flops_per_sample()  # forward + backward, one sample
        # TensorBoard (rank 0): a resumed run drops events after its checkpoint's step; a
        # finished one, with nothing to add, gets no new event file.
        self.board = Board(os.path.join(run_dir, "tensorboard"),
                           purge_step=iteration + 1 if resumed else None) \
            if rt.is_main and not finished else NullBoard()
        self.profiler = ProfilerWindow.for_run(cfg.enable_manual_profiling, self.device,
                                               iteration, steps_per_epoch, total_steps)
        self.trace = TraceWindow.for_run(cfg.profile_trace, rt.rank, iteration, steps_per_epoch,
                                         total_steps)
        self.progress = Progress(steps_per_epoch, rt.global_batch, rt.is_main)
        self.data_wait = DataWait.for_device(self.device)
        self.epoch_sum = torch.zeros((), device=self.device)  # the epoch's summed step losses
        self.window = torch.zeros(2, device=self.device)  # [loss, grad norm] since the last log
        self.window_steps = 0
        self.checkpoint_s = 0.0  # this epoch's checkpoint writes, inside its wall time
        self.board.describe_run(derived | to_dict(cfg), f"Loss/valid_{task.baseline_name}")

    # ------------------------------------------------------------------ an epoch of steps

    def start_epoch(self, epoch: int, step_in_epoch: int, iteration: int, window_carry: tuple):
        """Before an epoch's first step (``step_in_epoch`` > 0 after a resume mid-epoch), the
        run at step ``iteration``; ``window_carry``: the loss window a stop between log points
        left in its checkpoint (loss and grad norm sums, steps)."""
        *carried, self.window_steps = window_carry
        self.window = torch.tensor(carried, device=self.device)
        self.epoch_sum = torch.zeros((), device=self.device)
        self.steps_run, self.t_first, self.checkpoint_s = 0, None, 0.0
        self.progress.start_epoch(epoch, step_in_epoch, last=min(
            self.steps_per_epoch, step_in_epoch + self.total_steps - iteration))
        self.data_wait.start_epoch()
        self.trace.step(iteration)  # the torch.profiler window may start here

    def fetching(self):
        """Around the fetch of one batch: timed as a wait for data."""
        return self.data_wait.fetching()

    def step_begins(self, iteration: int):
        """Before step ``iteration``, its batch fetched. Returns the memory probe for the step:
        the epoch's first step is measured."""
        self.profiler.step(iteration)
        if self.start_clock is not None:
            self.start_clock.mark("first batch")
        self.data_wait.step_begins()
        return self.probe if self.steps_run == 0 else NullProbe()

    def step_ends(self, loss: torch.Tensor, grad_norm: torch.Tensor, iteration: int,
                  step_in_epoch: int, measured: bool = True):
        """After a step, with its loss and gradient norm (device tensors, read at log points
        only) and the run's counts that include it; ``measured``: whether the step measured its
        memory (a replayed CUDA graph does not)."""
        self.data_wait.step_ends()
        if self.start_clock is not None:
            self.log_start()
        if self.steps_run == 0:
            if measured:
                self.log_memory()
            self.t_first = self.progress.clock()  # the steady state is timed from here
        self.epoch_sum += loss / self.rt.dp_size  # sum over steps of dp-mean losses
        self.window += torch.stack([loss, grad_norm])
        self.window_steps += 1
        self.steps_run += 1
        if iteration % self.cfg.log_every == 0:
            self.log_window(iteration, step_in_epoch)
        elif step_in_epoch != self.progress.last:  # (the window's line ends the epoch)
            self.progress.step(step_in_epoch, lr=self.next_lr(iteration))  # a line if 30 s passed

    def step_done(self, iteration: int):
        """After a step and its checkpoint: ends the step's range in the torch.profiler trace."""
        self.trace.step(iteration)

    def keep_out_of_trace(self, iteration: int):
        """No torch.profiler window over step ``iteration`` (train_graph.py's capture)."""
        self.trace.avoid(iteration)

    def end_epoch(self, iteration: int, step_in_epoch: int, loss_carry: float) -> EpochStats:
        """After the epoch's last step (or the run's); ``loss_carry``: the epoch's summed step
        losses before a resume mid-epoch. Waits for the device."""
        if self.window_steps:
            self.log_window(iteration, step_in_epoch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the epoch time must include the queued kernels
        # The progress lines' definition: the job's samples over the wall time since the epoch
        # began, its first step (memory probe, first batch after validation) included.
        elapsed = self.progress.clock() - self.progress.t0
        samples_per_s = self.progress.rate(step_in_epoch)
        steady = (self.steps_run - 1) * self.rt.global_batch / max(
            self.progress.clock() - self.t_first, 1e-9) if self.steps_run > 1 else None
        # One collective per epoch: the summed losses of all data-parallel ranks.
        total = self.rt.dp_sum(self.epoch_sum.clone().float()).item()
        avg = (total + loss_carry) / max(step_in_epoch, 1)
        return EpochStats(avg, elapsed, self.steps_run, samples_per_s, steady,
                          self.data_wait.share(elapsed) if self.steps_run else None,
                          self.checkpoint_s)

    # ------------------------------------------------------------------ what checkpoints keep

    def epoch_loss_sum(self) -> torch.Tensor:
        """This rank's summed step losses of the epoch so far (a device tensor)."""
        return self.epoch_sum

    def window_carry(self) -> tuple:
        """The loss window since the last log point (loss and grad norm sums, steps), which a
        checkpoint between log points keeps. Waits for the device."""
        return (*self.window.tolist(), self.window_steps)

    def checkpoint_took(self, seconds: float):
        """A checkpoint write took ``seconds`` of the epoch's wall time."""
        self.checkpoint_s += seconds

    # ------------------------------------------------------------------ the lines

    def log_start(self):
        """After the run's first step (waited for, once): how long the start took, by part."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.start_clock.mark("first step")
        for line in self.start_clock.lines():
            log.info(line)
        self.start_clock = None

    def log_memory(self):
        """Every rank's memory after the forward pass and at the step's peak (rank 0 logs)."""
        probe = self.probe
        mine = (probe.after_forward / GiB, probe.peak / GiB, resident_peak_bytes() / GiB)
        everyone = [mine] * self.rt.world_size
        if self.rt.distributed:
            dist.all_gather_object(everyone, mine)  # once per epoch
        fwd, peak, resident = zip(*everyone)
        if probe.after_forward:
            log.info(f"Memory after forward pass (GiB, per rank): {over_ranks(fwd, '.3f')}; "
                     f"peak: {over_ranks(peak, '.3f')}")
            log.info(f"  (measured as: {probe.method()})")
        else:
            log.info("Memory after forward pass: not measured (on a CPU it is counted from "
                     "autograd's saved tensors, which a compiled model does not expose)")
        if self.device.type == "cpu":
            log.info(f"  Process resident peak (GiB, per rank): {over_ranks(resident, '.2f')}")

    def next_lr(self, iteration: int) -> float:
        """The learning rate of the update after step ``iteration``, computed on the host as the
        schedule computes it (a captured step's rate is a device tensor: reading it would wait
        for the device)."""
        return lr_at(iteration, self.peak_lr, self.cfg.end_lr, self.cfg.warmup_steps,
                     self.total_steps)

    def log_window(self, iteration: int, step_in_epoch: int):
        """A log point: the steps' mean loss and gradient norm since the last one."""
        steps, window = self.window_steps, self.window
        # Host sync at the log interval: mean loss of the last `steps` steps over the dp ranks.
        loss = self.rt.dp_sum(window[0].clone().float()).item() / (steps * self.rt.dp_size)
        if not math.isfinite(loss):
            raise TrainingError(
                f"the training loss became {loss} before step {iteration}: lower lr "
                f"(peak {self.peak_lr:.3g}), use --amp_mode bf16 or none, and check the data. "
                f"{self.kept_checkpoints()}")
        lr = self.next_lr(iteration)
        self.progress.step(step_in_epoch, loss, lr)  # the progress line
        self.board.scalar("Loss/train", loss, iteration)
        self.board.scalar("Learning Rate", lr, iteration)
        self.board.scalar("Performance/samples per sec (epoch so far)",
                          self.progress.rate(step_in_epoch), iteration)
        # The norm is that of the whole (serial) gradient, the same on every rank.
        self.board.scalar("Grad norm", window[1].item() / steps, iteration)
        window.zero_()
        self.window_steps = 0

    def epoch(self, stats: EpochStats, val: dict, val_s: float, epoch: int, iteration: int):
        """Epoch ``epoch``'s lines in the log and its points in TensorBoard, after its
        validation (``val``, which took ``val_s`` seconds); the run at step ``iteration``."""
        it, board = iteration, self.board
        steps_per_s = stats.samples_per_s / self.rt.global_batch
        if stats.steps:
            log.info(f"Epoch {epoch + 1}: {stats.elapsed_s:.2f} s for {stats.steps} "
                     f"steps, {stats.samples_per_s:.2f} samples/s ({steps_per_s:.2f} steps/s)")
            if stats.checkpoint_s:  # in the epoch's time, as the tutorial's has none to hold
                rest = stats.samples_per_s * stats.elapsed_s / max(
                    stats.elapsed_s - stats.checkpoint_s, 1e-9)
                log.info(f"  {stats.checkpoint_s:.2f} s of it writing checkpoints; "
                         f"{rest:.2f} samples/s without them")
        else:  # resumed from a stop during this epoch's validation
            log.info(f"Epoch {epoch + 1}: its steps ran before the resume; its "
                     f"validation is run now")
        if stats.steps:
            # Who sets the pace: the loader when the step waited for data much of the epoch.
            steady = stats.steady_samples_per_s
            if stats.data_wait is not None:
                on = f", on rank 0 of {self.rt.world_size}" if self.rt.world_size > 1 else ""
                log.info(f"  Waited for data {100 * stats.data_wait:.0f}% of the epoch "
                         f"({self.data_wait.label}{on})" + (f"; steady state (after step 1) "
                                                       f"{steady:.2f} samples/s" if steady else ""))
                board.scalar("Performance/data wait share", stats.data_wait, it)
            samples_per_s = stats.samples_per_s  # the whole job's, over the epoch's wall time
            board.scalar("Avg iters per sec", steps_per_s, it)
            board.scalar("Avg samples per sec", samples_per_s, it)
            tflops = tflops_per_device(self.flops_per_sample, samples_per_s, self.rt.world_size)
            peak = peak_tflops(self.device, self.cfg.amp_mode,  # None on a CPU or unknown GPU
                               self.task.fp32_in_tf32())
            mfu = f", MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s peak" if peak else ""
            log.info(f"  Model {tflops:.3g} TFLOP/s per device "
                     f"({self.flops_per_sample / 1e9:.4g} GFLOP per sample){mfu}")
            board.scalar("Performance/TFLOPs per sec", tflops, it)
            if peak:
                board.scalar("Performance/MFU", tflops / peak, it)
        log.info(f"  Avg train loss={stats.avg_loss:.6f}")
        name = self.task.baseline_name
        log.info(f"  Avg val loss={val['loss']:.6f} ({name} baseline {val['baseline_loss']:.6f})")
        for line in self.task.metric_lines(val["metrics"], val["baseline_metrics"]):
            log.info(line)
        log.info(f"  Validation took {val_s:.2f} s")
        board.scalar("Loss/valid", val["loss"], it)
        board.scalar(f"Loss/valid_{name}", val["baseline_loss"], it)
        for tag, v in self.task.metric_scalars(val["metrics"]).items():
            board.scalar(tag, v, it)
        if val["picture"] is not None:
            board.image("Prediction vs target/valid", val["picture"], it)
        board.flush()

    def skill(self, scalars: dict, lines: list[str], seconds: float, iteration: int):
        """The model's skill as its science scores it (the task's ``skill``), which took
        ``seconds``: in the log and TensorBoard."""
        for line in lines:
            log.info(line)
        log.info(f"  Skill took {seconds:.2f} s")
        self.points(scalars, iteration)

    def points(self, scalars: dict, iteration: int):
        """TensorBoard points ``{tag: value}`` at step ``iteration``, written out now."""
        for tag, value in scalars.items():
            self.board.scalar(tag, value, iteration)
        self.board.flush()

    def summary(self, wall_s: float, val: dict | None, iteration: int):
        """The closing lines: the final validation loss (``val``, None when the run ended without
        one) beside the baseline, the wall time, where the run is and how to look at it."""
        cfg = self.cfg
        log.info(f"Summary: {cfg.name} run {cfg.run_num}, {wall_s:.1f} s of training and "
                 f"validation")
        if val is not None:
            log.info(f"  Final validation loss {val['loss']:.6g} ({self.task.baseline_name} "
                     f"baseline {val['baseline_loss']:.6g}) after {iteration} steps")
        log.info(f"  Run directory: {self.run_dir}")
        log.info(f"  Look at it: tensorboard --logdir {cfg.expdir}")

    def close(self):
        """The TensorBoard events written out and the file closed."""
        self.board.close()
