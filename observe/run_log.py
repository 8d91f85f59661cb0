"""The run log: everything a run shows (rank 0's lines, one per event, as docs/training.md ("What
a run prints") and docs/performance.md show and define them; TensorBoard; the profilers'
windows), owned by ``RunLog``, in the order of its methods."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from observe.logging_utils import Nothing, duration, over_ranks
from observe.memory import GiB, MemoryProbe, NullProbe, resident_peak_bytes
from observe.profiling import ProfilerWindow, StartClock, TraceWindow
from observe.tensorboard import Board
from settings.config import Config, to_dict
from settings.errors import TrainingError

STOP_GRACE_S = 60  # seconds a scheduler commonly gives between its stop signal and the kill
log = logging.getLogger("train")


# Dense (no sparsity) peak TFLOP/s of the SXM boards, from NVIDIA's datasheets; the PCIe/NVL
# boards run at lower clocks, so on them MFU reads high. The H200 has the H100 SXM's compute.
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def peak_tflops(device, amp_mode: str, allow_tf32: bool | None = None) -> float | None:
    """Dense peak TFLOP/s of ``device`` (a ``torch.device`` or a GPU's name) at the precision
    ``amp_mode`` computes in (none: tf32 where ``allow_tf32``, the task's switch for its FLOPs);
    None for a CPU or a GPU not in ``PEAK_TFLOPS``."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = torch.cuda.get_device_name(device)
    if amp_mode == "none" and allow_tf32 is None:
        raise ValueError("amp_mode none: say whether the model's fp32 FLOPs run in TF32")
    precision = amp_mode if amp_mode != "none" else "tf32" if allow_tf32 else "fp32"
    model = next((m for m in PEAK_TFLOPS if m in device.upper()), None)
    return PEAK_TFLOPS[model][precision] if model else None


def log_run_header(model, rt, loaders, total_steps: int, layout_summary: str | None,
                   workers: int, task):
    """The device and ranks (``rt``: ``engine.runtime.Runtime``), the model and its size, each
    rank's threads and loader workers, the model-parallel layout, the data and steps the run
    will train on, and the loss."""
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"Device {rt.device}, {rt.world_size} rank(s), {rt.dp_size} data-parallel; model "
             f"{type(model).__name__} with {n_params / 1e6:.2f} M parameters"
             + (" on this rank" if rt.groups is not None else ""))
    log.info(f"Per rank: {torch.get_num_threads()} intra-op threads (OMP_NUM_THREADS), "
             f"{workers} loader workers (num_data_workers)")
    if rt.groups is not None:
        log.info("Model-parallel layout: " + rt.groups.describe())
        log.info(layout_summary)
    log.info(f"{loaders.n_train} training samples, {loaders.n_valid} validation samples; "
             f"{loaders.steps_per_epoch} steps per epoch of {rt.global_batch} samples "
             f"({rt.local_batch} per rank); {total_steps} steps in all")
    log.info(f"Loss: {task.loss_name or type(task.loss).__name__}")


class Progress:
    """The progress lines: at every log point (where the loss is read back anyway) and, on long
    steps, at least every ``every_s`` seconds, with the latest log point's loss and its step
    (reading a new one would make every rank wait)."""

    def __init__(self, steps_per_epoch: int, global_batch: int, enabled: bool,
                 every_s: float = 30.0, clock=time.monotonic):
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch
        self.enabled, self.every_s, self.clock = enabled, every_s, clock
        self.loss = self.lr = math.nan
        self.loss_at = None  # (epoch, step in epoch) of the log point that read ``loss``

    def start_epoch(self, epoch: int, step_in_epoch: int, last: int):
        """Before the epoch's first step (``step_in_epoch`` > 0 after a resume mid-epoch);
        ``last``: the step in the epoch it will end at (the run may end first)."""
        self.epoch, self.first, self.last = epoch, step_in_epoch, last
        self.t0 = self.last_line = self.clock()
        self.t1 = None  # when this epoch's first step ended

    def rate(self, step_in_epoch: int) -> float:
        """Samples/s of the job since ``start_epoch``."""
        elapsed = self.clock() - self.t0
        return (step_in_epoch - self.first) * self.global_batch / max(elapsed, 1e-9)

    def step(self, step_in_epoch: int, loss: float | None = None, lr: float | None = None):
        """After each step, with the next one's learning rate: a line at a log point (``loss``)
        or when ``every_s`` has passed since the last line."""
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
        n, done, left = self.steps_per_epoch, step_in_epoch - self.first, self.last - step_in_epoch
        if done > 1 and self.t1 is not None:  # the pace after the first step
            eta = (self.clock() - self.t1) / (done - 1) * left
        else:
            eta = (self.clock() - self.t0) / done * left if done else math.nan
        loss = ""
        if math.isfinite(self.loss):
            epoch, at = self.loss_at
            at = "" if (epoch, at) == (self.epoch, step_in_epoch) else (  # an earlier log point's
                f" (at step {at})" if epoch == self.epoch else f" (at epoch {epoch + 1} step {at})")
            loss = f"train loss {self.loss:.4g}{at}, "
        if math.isfinite(self.lr):
            loss += f"lr {self.lr:.3g}, "
        return (f"Epoch {self.epoch + 1} step {step_in_epoch}/{n} ({100 * step_in_epoch // n}%): "
                f"{self.rate(step_in_epoch):.1f} samples/s, {loss}"
                f"epoch ETA {duration(eta) if done else '?'}")


class DataWait:
    """The share of an epoch the step waited for data. On a CPU: the time spent fetching
    batches (the host runs the step, so nothing is computed meanwhile). On a GPU: the device's
    idle share outside the CUDA events that bracket each step's work (the batch's copy
    included), read at the epoch's end (which waits anyway)."""

    def __init__(self, device: torch.device, clock=time.monotonic,
                 event=lambda: torch.cuda.Event(enable_timing=True)):
        self.on_gpu = device.type == "cuda"
        self.label = "device idle" if self.on_gpu else "fetching batches"
        self.clock, self.event, self.pairs = clock, event, []  # events are made once and reused
        self.start_epoch()

    def start_epoch(self):
        self.waited, self.n = 0.0, 0

    @contextlib.contextmanager
    def fetching(self):
        """Around the fetch of one batch."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.waited += self.clock() - t0

    def step_begins(self):
        if self.on_gpu:
            if self.n == len(self.pairs):
                self.pairs.append((self.event(), self.event()))
            self.pairs[self.n][0].record()

    def step_ends(self):
        if self.on_gpu:
            self.pairs[self.n][1].record()
            self.n += 1

    def share(self, elapsed_s: float) -> float:
        """At the epoch's end (after the device finished): the waiting share of ``elapsed_s``."""
        if not self.on_gpu:
            return min(1.0, self.waited / max(elapsed_s, 1e-9))
        busy_s = sum(a.elapsed_time(b) for a, b in self.pairs[:self.n]) / 1e3  # ms -> s
        return min(1.0, max(0.0, 1.0 - busy_s / max(elapsed_s, 1e-9)))


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
    def __init__(self, cfg: Config, rt, task, *, run_dir: str, start_clock: StartClock, model,
                 optimizer, iteration: int, lr, resumed: bool, derived: dict,
                 kept_checkpoints):
        """``start_clock``: the start's parts so far; ``model``, ``optimizer``: what the memory
        probe counts; ``iteration``: the step this launch starts at; ``lr(n)``: update ``n``'s
        learning rate computed on the host (a captured step's is a device tensor, which would
        wait); ``derived``: the values
        the config implies (``steps_per_epoch``, ``total_steps`` and ``peak_lr`` among them);
        ``kept_checkpoints()``: what a bad loss leaves to resume from."""
        self.cfg, self.rt, self.task, self.device = cfg, rt, task, rt.device
        self.run_dir, self.start_clock = run_dir, start_clock
        # (compiled graphs on a CPU do not expose the saved tensors the CPU probe hooks)
        self.probe = MemoryProbe(self.device, model, optimizer) \
            if self.device.type == "cuda" or not cfg.enable_jit else NullProbe()
        self.steps_per_epoch = steps_per_epoch = derived["steps_per_epoch"]
        self.total_steps = total_steps = derived["total_steps"]
        self.lr, self.peak_lr, self.kept_checkpoints = lr, derived["peak_lr"], kept_checkpoints
        # A resumed run drops the events after its checkpoint's step.
        self.board = Board(os.path.join(run_dir, "tensorboard"),
                           purge_step=iteration + 1 if resumed else None) \
            if rt.is_main else Nothing()
        self.profiler = ProfilerWindow.for_run(cfg.enable_manual_profiling, self.device,
                                               iteration, steps_per_epoch, total_steps)
        self.trace = TraceWindow.for_run(cfg.profile_trace, rt.rank, iteration, steps_per_epoch,
                                         total_steps)
        self.progress = Progress(steps_per_epoch, rt.global_batch, rt.is_main)
        self.data_wait = DataWait(self.device)
        self.fetching = self.data_wait.fetching  # around the fetch of one batch: a wait for data
        self.epoch_sum = torch.zeros((), device=self.device)  # this rank's step losses, summed
        self.window = torch.zeros(2, device=self.device)  # [loss, grad norm] since the last log
        self.window_steps = 0
        self.checkpoint_s = 0.0  # this epoch's checkpoint writes, inside its wall time
        self.step_t0, self.told_long_step = 0.0, not rt.is_main
        self.board.describe_run(derived | to_dict(cfg), f"Loss/valid_{task.baseline_name}")

    # ------------------------------------------------------------------ an epoch of steps

    def start_epoch(self, epoch: int, step_in_epoch: int, iteration: int, window_carry: tuple):
        """Before an epoch's first step, the run at step ``iteration``; ``window_carry``: the
        loss window a checkpoint between log points kept."""
        *carried, self.window_steps = window_carry
        self.window = torch.tensor(carried, device=self.device)
        self.epoch_sum = torch.zeros((), device=self.device)
        self.steps_run, self.checkpoint_s = 0, 0.0
        self.progress.start_epoch(epoch, step_in_epoch, last=min(
            self.steps_per_epoch, step_in_epoch + self.total_steps - iteration))
        self.data_wait.start_epoch()
        self.trace.step(iteration)  # the torch.profiler window may start here

    def step_begins(self, iteration: int):
        """Before step ``iteration``, its batch fetched: the step's memory probe (measuring the
        epoch's first step)."""
        self.profiler.step(iteration)
        if self.start_clock is not None:
            self.start_clock.mark("first batch")
        self.data_wait.step_begins()
        self.step_t0 = time.monotonic()
        return self.probe if self.steps_run == 0 else NullProbe()

    def step_ends(self, loss: torch.Tensor, grad_norm: torch.Tensor, iteration: int,
                  step_in_epoch: int, measured: bool = True):
        """After a step, with its loss and gradient norm (device tensors, read at log points
        only); ``measured``: whether it measured its memory (a replayed CUDA graph does not)."""
        self.data_wait.step_ends()
        if not self.told_long_step and (took := time.monotonic() - self.step_t0) > STOP_GRACE_S:
            self.told_long_step = True  # a stop signal waits for the step it comes in to end
            log.warning(f"Stop: step {iteration} took {duration(took)}, longer than the "
                        f"{STOP_GRACE_S} s a scheduler commonly allows between its stop signal "
                        f"and the kill: ask for the signal earlier (sbatch --signal=B:USR1@SECONDS; submit_pm.sh asks "
                        f"120 s before the end) or make the step shorter (a smaller batch)")
        if self.start_clock is not None:
            self.log_start()
        if self.steps_run == 0 and measured:
            self.log_memory()
        self.epoch_sum += loss / self.rt.dp_size  # sum over steps of dp-mean losses
        self.window += torch.stack([loss, grad_norm])
        self.window_steps += 1
        self.steps_run += 1
        if iteration % self.cfg.log_every == 0:
            self.log_window(iteration, step_in_epoch)
        elif step_in_epoch != self.progress.last:  # (the window's line ends the epoch)
            self.progress.step(step_in_epoch, lr=self.lr(iteration))  # a line if 30 s passed

    def step_done(self, iteration: int):
        """After a step and its checkpoint: ends the step's range in the torch.profiler trace."""
        self.trace.step(iteration)

    def keep_out_of_trace(self, iteration: int):
        """No torch.profiler window over step ``iteration`` (train_graph.py's capture)."""
        self.trace.avoid(iteration)

    def end_epoch(self, iteration: int, step_in_epoch: int, loss_carry: float) -> EpochStats:
        """After the epoch's (or the run's) last step; ``loss_carry``: the epoch's summed step
        losses before a resume mid-epoch. Waits for the device."""
        if self.window_steps:
            self.log_window(iteration, step_in_epoch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the epoch time must include the queued kernels
        # The progress lines' definition: the job's samples over the wall time since the epoch
        # began, its first step (memory probe, first batch after validation) included.
        elapsed = self.progress.clock() - self.progress.t0
        samples_per_s = self.progress.rate(step_in_epoch)
        steady = (self.steps_run - 1) * self.rt.global_batch / max(  # after the first step
            self.progress.clock() - self.progress.t1, 1e-9) if self.steps_run > 1 else None
        # One collective per epoch: the summed losses of all data-parallel ranks.
        total = self.rt.dp_sum(self.epoch_sum.clone().float()).item()
        avg = (total + loss_carry) / max(step_in_epoch, 1)
        return EpochStats(avg, elapsed, self.steps_run, samples_per_s, steady,
                          self.data_wait.share(elapsed) if self.steps_run else None,
                          self.checkpoint_s)

    def window_carry(self) -> tuple:
        """(loss sum, grad norm sum, steps) since the last log point, for a checkpoint between
        log points. Waits for the device."""
        return (*self.window.tolist(), self.window_steps)

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
        lr = self.lr(iteration)  # of the next update
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
        """Epoch ``epoch``'s lines and TensorBoard points, after its validation ``val`` (which
        took ``val_s`` seconds)."""
        if not math.isfinite(val["loss"]):
            raise TrainingError(f"the validation loss is {val['loss']} at step {iteration}: the "
                                f"model diverged; lower lr or check the data; checkpoints "
                                f"already written are kept in "
                                f"{os.path.join(self.run_dir, 'checkpoints')}")
        name = self.task.baseline_name
        points = {"Loss/valid": val["loss"], f"Loss/valid_{name}": val["baseline_loss"],
                  **self.task.metric_scalars(val["metrics"])}
        steps_per_s = stats.samples_per_s / self.rt.global_batch
        if not stats.steps:  # resumed from a stop during this epoch's validation
            log.info(f"Epoch {epoch + 1}: its steps ran before the resume; its "
                     f"validation is run now")
        else:  # samples/s: the whole job's, over the epoch's wall time
            log.info(f"Epoch {epoch + 1}: {stats.elapsed_s:.2f} s for {stats.steps} "
                     f"steps, {stats.samples_per_s:.2f} samples/s ({steps_per_s:.2f} steps/s)")
            if stats.checkpoint_s:  # in the epoch's time, as the tutorial's has none to hold
                rest = stats.samples_per_s * stats.elapsed_s / max(
                    stats.elapsed_s - stats.checkpoint_s, 1e-9)
                log.info(f"  {stats.checkpoint_s:.2f} s of it writing checkpoints; "
                         f"{rest:.2f} samples/s without them")
            # Who sets the pace: the loader when the step waited for data much of the epoch.
            steady = stats.steady_samples_per_s
            if stats.data_wait is not None:
                on = f", on rank 0 of {self.rt.world_size}" if self.rt.world_size > 1 else ""
                log.info(f"  Waited for data {100 * stats.data_wait:.0f}% of the epoch "
                         f"({self.data_wait.label}{on})" + (f"; steady state (after step 1) "
                                                       f"{steady:.2f} samples/s" if steady else ""))
                points["Performance/data wait share"] = stats.data_wait
            # Per device: the job's FLOP/s over every rank, those of a tensor/context-parallel
            # replica, which share each sample, included.
            flops = self.task.flops_per_sample(epoch)  # a sample's forward and backward passes
            tflops = flops * stats.samples_per_s / self.rt.world_size / 1e12
            peak = peak_tflops(self.device, self.cfg.amp_mode,  # None on a CPU or unknown GPU
                               self.task.fp32_in_tf32())
            mfu = f", MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s peak" if peak else ""
            log.info(f"  Model {tflops:.3g} TFLOP/s per device "
                     f"({flops / 1e9:.4g} GFLOP per sample){mfu}")
            points |= {"Avg iters per sec": steps_per_s,
                       "Avg samples per sec": stats.samples_per_s,
                       "Performance/TFLOPs per sec": tflops}
            if peak:
                points["Performance/MFU"] = tflops / peak
        log.info(f"  Avg train loss={stats.avg_loss:.6f}")
        log.info(f"  Avg val loss={val['loss']:.6f} ({name} baseline {val['baseline_loss']:.6f})")
        for line in self.task.metric_lines(val["metrics"], val["baseline_metrics"]):
            log.info(line)
        log.info(f"  Validation took {val_s:.2f} s")
        if val["picture"] is not None:
            self.board.image("Prediction vs target/valid", val["picture"], iteration)
        self.points(points, iteration)

    def skill(self, scalars: dict, lines: list[str], seconds: float, iteration: int):
        """The task's ``skill`` lines and points, which took ``seconds``."""
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
        """The closing lines: the wall time, the final validation loss (``val``, None without
        one) beside the baseline, the run directory and how to look at it."""
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
