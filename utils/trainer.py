"""The training engine shared by every entry script: set-up, train_step, validate, fit.

Host-device synchronisations (``.item()``, collectives for logging) happen only at log points
(every ``log_every`` steps), at epoch ends and at checkpoints; a training step itself never waits
for the device.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from utils import checkpoint
from utils.config import Config, dump, to_dict
from utils.data_loader import build_loaders, has_data, synthesize
from utils.errors import ConfigError, TrainingError
from utils.logging_utils import setup_logging
from utils.lr_schedule import build_scheduler, peak_lr
from utils.memory import GB, MemoryProbe, NullProbe, resident_peak_bytes
from utils.model_io import ParallelIO, SerialIO
from utils.parallel import Runtime
from utils.profiling import ProfilerWindow, nvtx_range
from utils.tasks import make_task
from utils.tensorboard import Board, NullBoard

log = logging.getLogger(__name__)


def _buffer_sync_kwargs(disable: bool) -> dict:
    """DDP's per-step broadcast of module buffers from rank 0: on unless disabled. Newer torch
    calls the switch forward_sync_buffers (and warns on every rank when broadcast_buffers is
    passed at all); buffers are still made equal once, at wrapping."""
    if not disable:
        return {}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def run_dir_for(cfg: Config, world_size: int) -> str:
    return os.path.join(cfg.expdir, cfg.name, str(world_size), str(cfg.run_num))


class Trainer:
    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.device = rt.device
        self.run_dir = run_dir_for(cfg, rt.world_size)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        setup_logging(rt.rank, os.path.join(self.run_dir, "out.log"))
        resume_state = self._check_run_dir()
        self._ensure_data()

        self.task = make_task(cfg)
        self.loaders = build_loaders(cfg, rt.dp_size, rt.dp_rank, rt.local_batch, self.device)
        self.steps_per_epoch = self.loaders.steps_per_epoch
        self.total_steps = cfg.num_iters or cfg.num_epochs * self.steps_per_epoch

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = self.task.build_model()  # on the CPU: a sharded model never lives whole on a GPU
        if rt.mp is not None:
            from distributed.parallelize import parallelize_vit

            # Each rank keeps its slices of the serial weights: the same start as a serial run.
            model = parallelize_vit(model, rt.mp, cfg.activation_checkpointing, cfg.sequence_parallel)
            self.io = ParallelIO(self.task, model, rt.mp)
        else:
            self.io = SerialIO(self.task)
        self.model = model.to(self.device)
        torch.manual_seed(cfg.seed + 1 + rt.rank)  # per-rank stream for dropout

        self.peak_lr = peak_lr(cfg.lr, rt.global_batch, cfg.base_batch_size, cfg.lr_scaling)
        self.optimizer = self._optimizer()
        self.scheduler = build_scheduler(self.optimizer, self.peak_lr, cfg.end_lr,
                                         cfg.warmup_steps, self.total_steps)
        amp = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.amp_mode]
        # Disabled AMP is a do-nothing autocast and a do-nothing scaler, not a branch.
        self.autocast = lambda: torch.autocast(self.device.type, dtype=amp or torch.float32,
                                               enabled=amp is not None)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.amp_mode == "fp16")
        self.fwd = self._wrap(self.model)
        # The CPU probe hooks autograd's saved tensors, which compiled graphs do not expose.
        measurable = self.device.type == "cuda" or not cfg.enable_jit
        self.probe = MemoryProbe(self.device, self.model, self.optimizer) if measurable \
            else NullProbe()
        self.profiler = ProfilerWindow(cfg.enable_manual_profiling, start=self.steps_per_epoch)

        self.iteration, self.epoch, self.step_in_epoch = 0, 0, 0
        self.epoch_loss_carry = 0.0  # this epoch's summed step losses before a resume
        if resume_state is not None:
            self._restore(resume_state)
        self.board = Board(os.path.join(self.run_dir, "tensorboard"),
                           purge_step=self.iteration + 1 if resume_state else None) \
            if rt.is_main else NullBoard()
        self._baseline = None
        self._log_header()

    # ------------------------------------------------------------------ set-up helpers

    def _check_run_dir(self):
        """Refuse to overwrite a run that holds checkpoints; find the one to resume from."""
        cfg = self.cfg
        existing = checkpoint.list_checkpoints(self.ckpt_dir)
        if cfg.resume_from:
            if existing:
                raise ConfigError(f"--resume_from: {self.run_dir} already holds checkpoints: "
                                  f"use --resume to continue it, or choose another --run_num")
            src = cfg.resume_from
            if os.path.isdir(src) and os.path.isdir(os.path.join(src, "checkpoints")):
                src = os.path.join(src, "checkpoints")
            if os.path.isdir(src):
                state, path = checkpoint.load_latest(src)
            elif os.path.isfile(src):
                state, path = checkpoint.load_file(src)
            else:
                raise ConfigError(f"--resume_from {src}: no such file or directory")
            if state is None:
                raise ConfigError(f"--resume_from {src}: no checkpoint there loads")
        elif not cfg.resume:
            if existing:
                raise ConfigError(f"{self.run_dir} already holds checkpoints: pass --resume to "
                                  f"continue that run, or choose another --run_num")
            return None
        else:
            if not existing:
                raise ConfigError(f"--resume: no checkpoint in {self.ckpt_dir}: check --config, "
                                  f"--run_num, --expdir and the number of ranks "
                                  f"({self.rt.world_size}), or use --resume_from PATH")
            state, path = checkpoint.load_latest(self.ckpt_dir)
            if state is None:
                raise ConfigError(f"--resume: none of the checkpoints in {self.ckpt_dir} loads")
        self.resume_path = path
        return state

    def _ensure_data(self):
        cfg = self.cfg
        if not cfg.synthesize_if_missing:
            return
        # Rank 0 alone decides and writes; every rank then waits, so none sees a data set that
        # is still being written (e.g. the training file but not yet the validation file).
        if self.rt.is_main and not has_data(cfg):
            log.info(f"No data under {cfg.data_root}: generating synthetic {cfg.model} data there "
                     f"(synthesize_if_missing is set for this config)")
            t0 = time.time()
            synthesize(cfg)
            log.info(f"Synthetic data written in {time.time() - t0:.1f} s")
        self.rt.barrier()  # other ranks read the data only once it is complete

    def _optimizer(self):
        params = self.model.parameters()
        if self.cfg.enable_fused:
            try:
                return torch.optim.Adam(params, lr=self.peak_lr, fused=True)
            except (RuntimeError, TypeError) as e:
                log.warning(f"fused Adam is not available on {self.device.type} ({e}); "
                            f"using the default implementation")
                params = self.model.parameters()
        return torch.optim.Adam(params, lr=self.peak_lr)

    def _wrap(self, model):
        cfg, rt = self.cfg, self.rt
        fwd = model
        if rt.distributed and cfg.noddp:
            log.warning("noddp is set: gradients are NOT all-reduced; the model replicas are not "
                        "synchronised (for compute-only scaling measurements)")
        elif rt.distributed and (rt.dp_size > 1 or rt.mp is not None):
            fwd = DistributedDataParallel(
                model, device_ids=[rt.local_rank] if self.device.type == "cuda" else None,
                process_group=rt.dp_group, bucket_cap_mb=cfg.bucket_cap_mb,
                **_buffer_sync_kwargs(cfg.disable_broadcast_buffers))
            self.io.register_grad_hooks(fwd)
        if cfg.enable_jit:
            fwd = torch.compile(fwd)
        return fwd

    def _log_header(self):
        cfg, rt = self.cfg, self.rt
        n_params = sum(p.numel() for p in self.model.parameters())
        derived = self.derived()
        log.info(f"Run directory: {self.run_dir}")
        log.info("Resolved config:\n" + dump(cfg, derived))
        if rt.is_main and (not cfg.resume or not os.path.exists(self._config_path())):
            with open(self._config_path(), "w") as f:
                f.write(dump(cfg, derived))
        log.info(f"Device {self.device}, {rt.world_size} rank(s), {rt.dp_size} data-parallel; "
                 f"model {type(self.model).__name__} with {n_params / 1e6:.2f} M parameters"
                 + (" on this rank" if rt.mp is not None else ""))
        if rt.mp is not None:
            log.info("Model-parallel layout: " + rt.mp.describe())
            log.info(self.model.sequence_parallel_summary())
        log.info(f"{self.loaders.n_train} training samples, {self.loaders.n_valid} validation "
                 f"samples; {self.steps_per_epoch} steps per epoch of {rt.global_batch} samples "
                 f"({rt.local_batch} per rank); {self.total_steps} steps in all")

    def _config_path(self):
        return os.path.join(self.run_dir, "config.yaml")

    def derived(self) -> dict:
        return {"world_size": self.rt.world_size, "data_parallel": self.rt.dp_size,
                "local_batch_size": self.rt.local_batch,
                "global_batch_size": self.rt.global_batch, "peak_lr": self.peak_lr,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "device": str(self.device)}

    # ------------------------------------------------------------------ training

    def to_device(self, x, y):
        # non_blocking overlaps the copy with compute when the batch sits in pinned memory
        return (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))

    def train_step(self, x, y, probe=NullProbe()) -> torch.Tensor:
        """One optimizer step on this rank's part of the global batch; returns the loss tensor
        (not synchronised)."""
        x, y = self.io.inputs(x, y)
        with probe.step():
            with nvtx_range("forward"), self.autocast():
                pred = self.fwd(x)
                loss = self.io.loss(pred, y).mean()
            probe.forward_done()
            with nvtx_range("backward"):
                self.scaler.scale(loss).backward()  # DDP all-reduces gradients here, overlapped
            with nvtx_range("optimizer"):
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
        return loss.detach()

    def fit(self):
        log.info("Starting training loop...")
        while self.iteration < self.total_steps:
            self._train_epoch()
            self._validate_and_log()
            self.epoch += 1
            self.step_in_epoch = 0
            self.epoch_loss_carry = 0.0
        if not os.path.exists(checkpoint.path_for(self.ckpt_dir, self.iteration)):
            self.save_checkpoint()
        self.board.close()
        log.info(f"Done: {self.iteration} steps, checkpoints in {self.ckpt_dir}")

    def _train_epoch(self):
        cfg, rt = self.cfg, self.rt
        sampler = self.loaders.train_sampler
        sampler.set_epoch(self.epoch, self.step_in_epoch)
        self.model.train()
        epoch_sum = torch.zeros((), device=self.device)  # sum over steps of dp-mean losses
        window_sum = torch.zeros((), device=self.device)
        window_steps, steps_run = 0, 0
        t0 = time.time()
        for x, y in self.loaders.train:
            if self.iteration >= self.total_steps:
                break
            self.profiler.step(self.iteration)
            probe = self.probe if steps_run == 0 else NullProbe()  # first step of each epoch
            with nvtx_range(f"step {self.iteration}"):
                x, y = self.to_device(x, y)
                loss = self.train_step(x, y, probe)
            if steps_run == 0:
                self._log_memory(probe)
                t_first = time.time()  # throughput is timed from here: step 1 measures memory
            epoch_sum += loss / rt.dp_size
            window_sum += loss
            window_steps += 1
            steps_run += 1
            self.iteration += 1
            self.step_in_epoch += 1
            if self.iteration % cfg.log_every == 0:
                self._log_train_window(window_sum, window_steps)
                window_sum.zero_()
                window_steps = 0
            if cfg.checkpoint_every and self.iteration % cfg.checkpoint_every == 0:
                self.save_checkpoint(epoch_sum)
        if window_steps:
            self._log_train_window(window_sum, window_steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the epoch time must include the queued kernels
        t_end = time.time()
        elapsed = t_end - t0
        timed = (steps_run - 1, t_end - t_first) if steps_run > 1 else (steps_run, elapsed)
        # One collective per epoch: the average train loss over all steps and ranks.
        total = rt.all_reduce(epoch_sum.clone().float())
        steps = self.step_in_epoch
        avg = (total.item() + self.epoch_loss_carry) / max(steps, 1)
        self._epoch_train = (avg, elapsed, steps_run, timed)

    def _log_memory(self, probe):
        """Every rank's memory after the forward pass and at the step's peak (rank 0 logs)."""
        mine = (probe.after_forward / GB, probe.peak / GB, resident_peak_bytes() / GB)
        everyone = [mine] * self.rt.world_size
        if self.rt.distributed:
            dist.all_gather_object(everyone, mine)  # once per epoch
        if probe.after_forward == 0:
            return
        fwd = ", ".join(f"{a:.3f}" for a, _, _ in everyone)
        peak = ", ".join(f"{b:.3f}" for _, b, _ in everyone)
        log.info(f"Memory after forward pass (GB, per rank): {fwd}; peak: {peak} "
                 f"[{probe.method()}]")
        if self.device.type == "cpu":
            log.info("  Process resident peak (GB, per rank): "
                     + ", ".join(f"{c:.2f}" for _, _, c in everyone))

    def _log_train_window(self, window_sum, steps):
        # Host sync at the log interval: mean loss of the last `steps` steps over the dp ranks.
        value = self.rt.all_reduce(window_sum.clone().float()).item() / (steps * self.rt.dp_size)
        if not math.isfinite(value):
            raise TrainingError(
                f"the training loss became {value} before step {self.iteration}: lower lr "
                f"(peak {self.peak_lr:.3g}), use --amp_mode bf16 or none, and check the data; "
                f"checkpoints already written are kept in {self.ckpt_dir}")
        self.board.scalar("Loss/train", value, self.iteration)
        self.board.scalar("Learning Rate", self.optimizer.param_groups[0]["lr"], self.iteration)

    def _validate_and_log(self):
        avg, elapsed, steps_run, (timed_steps, timed_s) = self._epoch_train
        rt = self.rt
        n = self.epoch + 1
        if steps_run:
            rate = timed_steps / max(timed_s, 1e-9)
            log.info(f"Epoch {n}: {elapsed:.2f} s for {steps_run} steps, "
                     f"{rate * rt.global_batch:.2f} samples/s ({rate:.2f} steps/s)")
            self.board.scalar("Avg iters per sec", rate, self.iteration)
            self.board.scalar("Avg samples per sec", rate * rt.global_batch, self.iteration)
        log.info(f"  Avg train loss={avg:.6f}")
        t0 = time.time()
        val = self.validate()
        vt = time.time() - t0
        base = val.get("baseline_loss")
        base_txt = f" ({self.task.baseline_name} baseline {base:.6f})" if base is not None else ""
        log.info(f"  Avg val loss={val['loss']:.6f}{base_txt}")
        for line in self.task.metric_lines(val["metrics"], val.get("baseline_metrics")):
            log.info(line)
        log.info(f"  Validation took {vt:.2f} s")
        self.board.scalar("Loss/valid", val["loss"], self.iteration)
        if base is not None:
            self.board.scalar(f"Loss/valid_{self.task.baseline_name}", base, self.iteration)
        for tag, v in self.task.metric_scalars(val["metrics"]).items():
            self.board.scalar(tag, v, self.iteration)
        if val.get("picture") is not None:
            self.board.image("Prediction vs target/valid", val["picture"], self.iteration)
        self.board.flush()
        self.last_val = val

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and metrics over the whole validation set (all ranks), and the naive baseline."""
        self.model.eval()
        want_base = self._baseline is None
        n_metrics = None
        sums = None
        picture = None
        for x, y in self.loaders.valid:
            x, y = self.to_device(x, y)
            xi, yi = self.io.inputs(x, y)
            with self.autocast():
                pred = self.fwd(xi)
            pred = self.io.full_output(pred)
            per_sample = self.task.loss(pred, y).float()
            metrics = self.task.metric_sums(pred, y).float()
            if sums is None:
                n_metrics = metrics.numel()
                # [loss, count, metrics..., baseline loss, baseline metrics...]
                sums = torch.zeros(3 + 2 * n_metrics, device=self.device, dtype=torch.float64)
            sums[0] += per_sample.sum()
            sums[1] += y.shape[0]
            sums[2:2 + n_metrics] += metrics
            if want_base:
                bp = self.task.baseline_pred(x, y)
                if bp is not None:
                    sums[2 + n_metrics] += self.task.loss(bp, y).float().sum()
                    sums[3 + n_metrics:] += self.task.metric_sums(bp, y).float()
            if picture is None and self.rt.is_main:
                picture = self.task.picture(x, y, pred)
        self.model.train()
        if sums is None:
            raise TrainingError("the validation set is empty: check the validation data")
        # One collective per validation: sums over all data-parallel ranks.
        sums = self.rt.all_reduce(sums).cpu().numpy()
        count = sums[1]
        out = {"loss": sums[0] / count, "metrics": sums[2:2 + n_metrics] / count,
               "picture": picture, "count": int(count)}
        if want_base:
            self._baseline = (sums[2 + n_metrics] / count, sums[3 + n_metrics:] / count)
        if not math.isfinite(out["loss"]):
            raise TrainingError(f"the validation loss is {out['loss']} at step {self.iteration}: "
                                f"the model diverged; lower lr or check the data; checkpoints "
                                f"already written are kept in {self.ckpt_dir}")
        out["baseline_loss"], out["baseline_metrics"] = self._baseline
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, epoch_sum: torch.Tensor | None = None):
        """Collective on all ranks (losses and RNG states are gathered); rank 0 writes."""
        rt = self.rt
        carried = self.epoch_loss_carry
        if epoch_sum is not None:
            carried += rt.all_reduce(epoch_sum.clone().float()).item()
        if not math.isfinite(carried):
            raise TrainingError(f"the training loss is not finite at step {self.iteration}; not "
                                f"writing a checkpoint. Lower lr or check the data; earlier "
                                f"checkpoints in {self.ckpt_dir} are kept")
        rng = checkpoint.rng_state()
        rngs = [None] * rt.world_size
        if rt.distributed:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        # Serial layout by parameter name (a collective under tensor/context parallelism), so
        # the checkpoint loads on any number of ranks and any layout.
        model_state = self.io.model_state(self.model)
        optimizer_state = self.io.optimizer_state(self.model, self.optimizer)
        if not rt.is_main:
            return
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "iteration": self.iteration,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "epoch_loss_sum": carried,
            "steps_per_epoch": self.steps_per_epoch,
            "rng": rngs,
            "config": to_dict(self.cfg),
            "world_size": rt.world_size,
        }
        path = checkpoint.save(self.ckpt_dir, self.iteration, state, self.cfg.checkpoint_keep)
        log.info(f"Checkpoint written: {path}")

    def _restore(self, state: dict):
        rt = self.rt
        if state["steps_per_epoch"] != self.steps_per_epoch:
            raise ConfigError(f"the checkpoint has {state['steps_per_epoch']} steps per epoch but "
                              f"this run has {self.steps_per_epoch}: resume with the same data "
                              f"and global batch size")
        try:
            self.io.load_model_state(self.model, state["model"])
            self.io.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{self.resume_path} does not fit this model ({type(e).__name__}: "
                              f"{e}): resume with the config that wrote it") from None
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.iteration = state["iteration"]
        self.epoch = state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        self.epoch_loss_carry = state["epoch_loss_sum"]
        rngs = state["rng"]
        checkpoint.set_rng_state(rngs[rt.rank % len(rngs)])
        log.info(f"Resumed from {self.resume_path} at step {self.iteration} "
                 f"(epoch {self.epoch + 1}, step {self.step_in_epoch} of {self.steps_per_epoch})")
