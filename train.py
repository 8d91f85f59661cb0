"""Train a ViT on ERA5 or a 3D U-Net on cosmology volumes from a named YAML config.

    python train.py                                   # ViT quickstart on synthetic data (CPU ok)
    python train.py --yaml_config config/UNet.yaml --config quickstart
    python train.py --config short --num_data_workers 8 --amp_mode bf16
    torchrun --nproc_per_node 4 train.py --config bs64_opt

Data parallel over every rank the launcher starts; tensor/context parallel: see train_mp.py.

The file reads top to bottom as a run does. Set-up is the recipe (``Trainer.__init__``): the run
directory, the data, the model and its parallelism, the optimizer and schedule, then the three
collaborators the loop talks to: the checkpointer (engine/checkpoint: which checkpoint to
resume, save), the stopper (engine/stop: the batches, whether the ranks stop) and the run log
(observe/run_log.py: progress lines, epoch lines, TensorBoard, profiler windows). Then one
optimizer step (``train_step``), an epoch of them (``train_epoch``), validation (``validate``)
and the loop over epochs (``fit``). Host-device synchronisations (``.item()``, collectives for
logging) happen only at log points (every ``log_every`` steps), at epoch ends and at
checkpoints; a step itself never waits for the device.
"""
import contextlib
import logging
import os
import sys
import time

from settings.cli import from_argv

if __name__ == "__main__":  # bad settings and --help are answered before torch loads (in 0.2 s)
    COMMAND_LINE_CONFIG = from_argv(sys.argv[1:])

import torch  # from here on: torch and the engine (seconds to load)

from datapipe.data_loader import build_loaders, ensure_data, validation_batch_sizes
from engine import throughput_report
from engine.checkpoint import Checkpointer, RunFinished
from engine.optimizer import (build_optimizer, build_scheduler, describe as describe_lr, lr_at,
                              peak_lr, resumed_schedule)
from engine.parallelism import apply_parallelism
from engine.run_dir import open_run_dir, write_config
from engine.runtime import AMP_DTYPES, check_torch_version, setup_runtime
from engine.stop import NeverStop, RunEnding, RunStopped, Stopper
from observe.profiling import StartClock, nvtx_range
from observe.run_log import EpochStats, RunLog, log_run_header
from tasks import make_task

log = logging.getLogger("train")


class Trainer:
    captures_step = False  # True in train_graph.py: the step is replayed as a CUDA graph

    def __init__(self, cfg, rt, ending: RunEnding | None = None):
        """The recipe: ``cfg`` the resolved settings, ``rt`` the runtime (device, ranks, process
        groups); ``ending``: how the run ends (``run`` makes it: it installs the stop signals'
        handlers), by default no signal stops the run."""
        self.cfg, self.rt, self.device = cfg, rt, rt.device
        clock = StartClock()  # the start's parts, logged after the first step (the run log's)
        clock.mark("imports and set-up")
        resume = self.open_run()  # 1. the run directory, its log, the checkpoint to resume
        ensure_data(self.cfg, rt.rank, rt.world_size)  # 2. the data (synthetic: made once)
        clock.mark("data")
        self.task = make_task(self.cfg)
        # The layout of the weights and batches on the device (the task's choice: channels-last
        # for the U-Net on a GPU in half precision); the numbers are the same either way.
        self.memory_format, why = self.task.memory_format(self.device)
        if why:
            log.info(f"Memory format: {str(self.memory_format).removeprefix('torch.')} ({why})")
        # The loaders before the model, their first training pass begun: the loader workers read
        # its first batches while the model is built. A model-parallel rank reads only the image
        # rows it computes on, which its model knows: its loaders follow the model.
        self.loaders = self.start_loaders(resume, clock) if rt.groups is None else None
        self.build_model(clock)  # 3. the model, parallelised in one place
        clock.mark("model")
        if self.loaders is None:
            self.loaders = self.start_loaders(resume, clock, self.model.image_rows())
        self.steps_per_epoch = self.loaders.steps_per_epoch
        self.total_steps = self.cfg.num_iters or self.cfg.num_epochs * self.steps_per_epoch
        self.build_optimizer(resume)  # 4. the optimizer and schedule, the run's state
        self.start_collaborators(ending or RunEnding(self.cfg, NeverStop()), clock)  # 5.
        clock.mark("optimizer and logs")

    def open_run(self):
        """The run directory, claimed and locked for this process, its out.log open; the
        checkpointer chooses the checkpoint to continue from (None: a fresh run)."""
        self.run_dir = open_run_dir(self.cfg, self.rt)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.checkpointer = Checkpointer(self.ckpt_dir, self.cfg, self.rt)
        resume = self.checkpointer.resume()  # rank 0's choice, read by every rank
        if resume is not None:  # to the end it had, unless the command gives another
            self.cfg = resume.cfg
        self.resumed = resume is not None
        return resume

    def start_loaders(self, resume, clock: StartClock, rows=None):
        """The training and validation loaders (``rows``: the image rows this rank reads, None
        for all), the training pass the run starts with begun (where ``resume``, the checkpoint
        the run continues from or None, left off); the start's ``clock`` marks them."""
        rt = self.rt
        loaders = build_loaders(self.cfg, rt.dp_size, rt.dp_rank, rt.local_batch, self.device,
                                rows, self.memory_format)
        state = resume.state if resume is not None else {}
        loaders.begin_training_pass(state.get("epoch", 0), state.get("step_in_epoch", 0))
        clock.mark("loaders")
        return loaders

    def build_model(self, clock: StartClock):
        """The serial model from the seed on every rank (or an earlier run's weights:
        --init_from), then parallelised in one place (``apply_parallelism``)."""
        cfg, rt = self.cfg, self.rt
        torch.manual_seed(cfg.seed)
        model = self.task.build_model()
        self.checkpointer.start_weights(model, self.task.from_reference)
        self.parallel = apply_parallelism(model, cfg, rt, self.task, self.memory_format)
        clock.compile_dir = self.parallel.compile_dir  # (compiled on the first step)
        self.model = self.parallel.module  # parameters and state (this rank's shards: tp/cp)
        self.wrapped_model = self.parallel.wrapped  # what the step calls: DDP / torch.compile
        self.sharding = self.parallel.sharding  # how batches and state map to this rank's model
        torch.manual_seed(cfg.seed + 1 + rt.rank)  # per-rank stream for dropout

    def build_optimizer(self, resume):
        """Adam with the schedule's peak learning rate, the schedule, mixed precision (disabled
        AMP is a do-nothing autocast and scaler, not a branch), and the run's state: at step 0,
        or put back from the checkpoint ``resume``."""
        cfg, rt = self.cfg, self.rt
        self.peak_lr = peak_lr(cfg.lr, rt.global_batch, cfg.base_batch_size, cfg.lr_scaling)
        self.optimizer = build_optimizer(self.model.parameters(), self.peak_lr, cfg.adam_betas,
                                         cfg.enable_fused, self.device,
                                         for_cuda_graph=self.captures_step)
        self.scheduler = build_scheduler(self.optimizer, self.peak_lr, cfg.end_lr,
                                         cfg.warmup_steps, self.total_steps)
        amp = AMP_DTYPES[cfg.amp_mode]
        # (a captured step cannot reuse autocast's cached weight casts between replays)
        self.autocast = lambda: torch.autocast(self.device.type, dtype=amp or torch.float32,
                                               enabled=amp is not None,
                                               cache_enabled=not self.captures_step)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.amp_mode == "fp16")
        self.kernels = self.task.forward_kernels(self.device, amp or torch.float32)
        self.state = self.checkpointer.load(self.model, self.sharding, self.optimizer,
                                            self.scaler, self.scheduler, self.steps_per_epoch)
        if resume is not None:
            change = resumed_schedule(self.optimizer, resume.state["config"], self.steps_per_epoch,
                                      self.iteration, self.peak_lr, cfg.end_lr, cfg.warmup_steps,
                                      self.total_steps)
            if change:
                log.info(change)

    def start_collaborators(self, ending: RunEnding, clock: StartClock):
        """The run log (everything the run shows) and the stopper (every fetch of a batch a
        wait that a stop signal or loader_timeout_s ends, and the ranks' agreement to stop: a
        host collective, never waited for per step); then the run's opening lines."""
        cfg, rt = self.cfg, self.rt
        self.run_log = RunLog(
            cfg, rt, self.task, run_dir=self.run_dir, start_clock=clock, model=self.model,
            optimizer=self.optimizer, iteration=self.iteration, resumed=self.resumed,
            lr=lambda n: lr_at(n, self.peak_lr, cfg.end_lr, cfg.warmup_steps, self.total_steps),
            derived=self.derived(),
            kept_checkpoints=self.checkpointer.kept)
        self.stopper = Stopper(ending.request, rt.distributed, rt.host_group, cfg.log_every,
                               cfg.loader_timeout_s, self.checkpointer.kept,
                               lambda message: ending.fail(message, 1, broken_group=True))
        self._baseline = None  # the naive baseline's validation loss, computed once
        log.info(f"Run directory: {self.run_dir}")
        if rt.is_main:
            write_config(cfg, self.run_dir, self.derived(), resumed=self.resumed)
        log_run_header(self.model, rt, self.loaders, self.total_steps,
                       getattr(self.model, "sequence_parallel_summary", lambda: None)(),
                       cfg.num_data_workers, self.task)
        log.info(describe_lr(cfg.lr, self.peak_lr, rt.global_batch, cfg.base_batch_size,
                             cfg.lr_scaling, cfg.warmup_steps, cfg.end_lr))

    @property
    def iteration(self) -> int:
        return self.state.iteration

    def derived(self) -> dict:
        """Values the config implies on this launch; written above the config in config.yaml."""
        rt = self.rt
        return {"world_size": rt.world_size, "data_parallel": rt.dp_size,
                "local_batch_size": rt.local_batch, "global_batch_size": rt.global_batch,
                "peak_lr": self.peak_lr, "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps, "device": str(self.device)}

    def to_device(self, x, y):
        # non_blocking overlaps the copy with compute when the batch sits in pinned memory; the
        # copy keeps the host layout, so a channels-last run converts once, on the device (a
        # no-op for the device loader's and the cached synthetic batches, made in that layout)
        x, y = (t.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format)
                for t in (x, y))
        return self.task.device_batch(x, y)  # e.g. ERA5 normalisation, on the device

    def forward_context(self):
        """The training forward's context: autocast and the task's kernels (attention)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        stack.enter_context(self.kernels())
        return stack

    # ------------------------------------------------------------------ one optimizer step

    def train_step(self, x, y, probe) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's share of the global batch (under tensor/context
        parallelism ``x`` and ``y`` hold this rank's image rows; ``probe``: what measures the
        step's memory, or a do-nothing ``observe.memory.NullProbe``). Returns the mean loss over the
        share and the gradient norm before clipping, as device tensors (no host sync)."""
        loss, grad_norm = self.update(x, y, probe)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # the next step's learning rate
        return loss, grad_norm

    def update(self, x, y, probe) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward passes in ``grad_accum_steps`` micro-batches, then the optimizer
        update: the part of a step that only launches device work (``train_graph.py`` captures
        it as a CUDA graph). Expects the gradients cleared (None)."""
        n, k = x.shape[0], self.cfg.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        with probe.step():
            for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
                # DDP all-reduces the gradients in the backward of the last micro-batch only;
                # FSDP reduce-scatters each micro-batch's (fsdp_reduce_each_microbatch).
                with self.parallel.no_sync() if i < k - 1 else contextlib.nullcontext():
                    with nvtx_range("forward"), self.autocast(), self.kernels():
                        loss = self.task.training_loss(self.wrapped_model, xm, ym,
                                                       self.parallel.loss, self.state.epoch)
                        loss = loss.sum() / n  # its part of the mean
                    if i == 0:
                        probe.forward_done()
                    with nvtx_range("backward"):
                        self.scaler.scale(loss).backward()  # DDP's all-reduce overlaps it
                loss_sum += loss.detach()
            with nvtx_range("optimizer"):
                self.parallel.reduce_replicated_grads()  # (FSDP x tp/cp: sums over tp/cp)
                self.scaler.unscale_(self.optimizer)  # clip the true gradients (fp16: unscaled)
                grad_norm = self.parallel.clip_grad_norm(self.cfg.max_grad_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
        return loss_sum, grad_norm

    # ------------------------------------------------------------------ an epoch of steps

    def train_epoch(self) -> EpochStats:
        st = self.state
        self.loaders.train_sampler.set_epoch(st.epoch, st.step_in_epoch)
        self.model.train()
        self.run_log.start_epoch(st.epoch, st.step_in_epoch, st.iteration, st.window_carry)
        st.window_carry = (0.0, 0.0, 0)  # (a stop between log points: its window, now logged)
        begun = self.loaders.begun_training_pass(st.epoch, st.step_in_epoch)  # (the run's first)
        # Each step's batch is fetched ahead (none past the run's last step) in a wait that a
        # stop signal or a stall ends, and the ranks' stop proposals after each fetch are
        # combined while the steps before run: on a signal that any rank proposed, every rank
        # stops at the same step, in stop_here.
        for x, y in self.stopper.batches(self.loaders.train, "training", st.epoch, st.iteration,
                                         st.step_in_epoch, self.total_steps, self.stop_here,
                                         self.run_log.fetching, begun):
            probe = self.run_log.step_begins(st.iteration)  # measures each epoch's first step
            with nvtx_range(f"step {st.iteration}"):
                x, y = self.to_device(x, y)
                # (not before a captured step: its eager warm-up counts DDP's iterations)
                if self.resumed and self.parallel.ddp is not None and not self.captures_step:
                    k = self.cfg.grad_accum_steps
                    self.parallel.regroup_gradients(x.chunk(k)[0], y.chunk(k)[0],
                                                    self.forward_context)
                self.resumed = False  # (the launch's first step is taken)
                loss, grad_norm = self.train_step(x, y, probe)
            # (told before the counts move on: the memory lines' exchange after an epoch's first
            # step belongs to that step, never to a steady one)
            self.run_log.step_ends(loss, grad_norm, st.iteration + 1, st.step_in_epoch + 1,
                                   measured=self.measured_memory())
            st.iteration += 1
            st.step_in_epoch += 1
            if self.checkpoint_due() and not self.validation_next():
                # (the epoch's last step: after its validation)
                self.save_checkpoint(self.run_log.epoch_sum)
            self.run_log.step_done(st.iteration)
        return self.run_log.end_epoch(st.iteration, st.step_in_epoch, st.epoch_loss_carry)

    def measured_memory(self) -> bool:
        """Whether the step just taken measured its memory (train_graph.py's replays do not)."""
        return True

    def checkpoint_due(self) -> bool:
        """Whether ``checkpoint_every`` asks for the checkpoint of the step just taken."""
        every = self.cfg.checkpoint_every
        return bool(every and self.iteration and self.iteration % every == 0)

    def validation_next(self) -> bool:
        """Whether the step just taken ends its epoch or the run: a validation follows, and the
        step's checkpoint is written after it (once), recording the validation as done."""
        return self.state.step_in_epoch == self.steps_per_epoch \
            or self.iteration >= self.total_steps

    def save_checkpoint(self, epoch_sum: torch.Tensor | None = None):
        """Collective on all ranks; rank 0 writes (under FSDP every rank writes its shards).
        ``epoch_sum``: this rank's summed step losses of the epoch so far (None at an epoch's
        end)."""
        seconds = self.checkpointer.save(epoch_sum, self.run_log.window_carry())
        self.run_log.checkpoint_s += seconds  # (inside the epoch's wall time)

    def stop_here(self, signum: int):
        """Every rank writes the checkpoint of the last finished step and raises RunStopped.
        Reached when the ranks' stop agreement says so, the same on every rank: between two
        steps, or after a validation that a stop signal cut short."""
        if not (self.checkpoint_due() and not self.validation_next()):
            # (unless this step's periodic one is written)
            self.save_checkpoint(self.run_log.epoch_sum)
        raise RunStopped(signum, self.iteration, self.checkpointer.written_for(self.iteration))

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and metrics over the whole validation set (all ranks), and the naive baseline's.

        Every data-parallel rank runs as many forwards as the largest shard has batches: a rank
        whose shard ends sooner, or whose wait for a batch a stop signal ended, runs the rest on
        a stand-in (its first batch, cut to the size its model-parallel peers have) and drops
        the results, so the forwards' collectives (FSDP's weight gathers, tp/cp's activations)
        always meet their peers'; the sums are those of the real batches alone."""
        self.model.eval()
        sums = picture = stand_in = None
        rt, valid = self.rt, self.loaders.valid
        sizes = validation_batch_sizes(self.loaders.n_valid, rt.dp_size, rt.dp_rank,
                                       rt.local_batch)
        for size, batch in self.stopper.validation_batches(valid, self.state.epoch, sizes,
                                                           self.loaders.n_valid):
            if batch is None:  # no batch for this forward: the stand-in's, results dropped
                x = self.parallel.full_batch(stand_in[:size] if size else stand_in)
                with self.forward_context():
                    self.task.forecast(self.wrapped_model, self.sharding.local_batch(x, x)[0],
                                       self.sharding.whole_output)
                continue
            x, y = self.to_device(*batch)
            stand_in = x if stand_in is None else stand_in
            xs = self.parallel.full_batch(x)
            with self.forward_context():
                pred = self.task.forecast(self.wrapped_model, self.sharding.local_batch(xs, xs)[0],
                                          self.sharding.whole_output)[:y.shape[0]]
            sums = self.add_sums(sums, x, y, pred)
            if picture is None and self.rt.is_main:
                picture = self.task.picture(x, y, pred)
        self.model.train()
        # Collective (host, once per validation): a wait for data that a stop signal ended, on
        # any rank, stops every rank before the validation's sums are combined.
        signum = self.stopper.stop_agreed()
        if signum:
            self.stop_here(signum)
        return self.combine_sums(sums) | {"picture": picture}

    def add_sums(self, sums, x, y, pred) -> torch.Tensor:
        """``sums`` (None at first) with the batch's added, in float64 on the device: [loss,
        count, metrics..., baseline loss, baseline metrics...] (the baseline's while its
        validation loss is not known yet)."""
        metrics = self.task.metric_sums(pred, y).float()
        m = metrics.numel()
        if sums is None:
            sums = torch.zeros(3 + 2 * m, device=self.device, dtype=torch.float64)
        sums[0] += self.task.loss(pred, y).float().sum()
        sums[1] += y.shape[0]
        sums[2:2 + m] += metrics
        base = self.task.baseline_pred(x, y) if self._baseline is None else None
        if base is not None:
            sums[2 + m] += self.task.loss(base, y).float().sum()
            sums[3 + m:] += self.task.metric_sums(base, y).float()
        return sums

    def combine_sums(self, sums) -> dict:
        """The validation's means over all data-parallel ranks, from each rank's ``sums`` (the
        run log checks that the loss is finite)."""
        assert sums is not None, "a validation with no batch (the stopper refuses it)"
        m = (len(sums) - 3) // 2
        sums = self.rt.dp_sum(sums).cpu().numpy()  # one collective per validation
        count = sums[1]
        if self._baseline is None:
            self._baseline = (sums[2 + m] / count, sums[3 + m:] / count)
        return {"loss": sums[0] / count, "metrics": sums[2:2 + m] / count, "count": int(count),
                "baseline_loss": self._baseline[0], "baseline_metrics": self._baseline[1]}

    def skill(self):
        """After an epoch's validation, the model's skill as its science scores it, where the
        task gives one then (the ViT's ``skill_every``), to the run log. Collective: every
        data-parallel rank scores its share."""
        t0 = time.time()
        self.model.eval()
        try:
            got = self.task.skill(self.model, self.device, self.forward_context,
                                  self.state.epoch, self.rt.dp_rank, self.rt.dp_size)
        finally:
            self.model.train()
        if got is not None:
            scalars, lines = got
            self.run_log.skill(scalars, lines, time.time() - t0, self.iteration)

    # ------------------------------------------------------------------ the loop

    def fit(self):
        log.info("Starting training loop...")
        t_start = time.time()
        val = None
        # step_in_epoch > 0 at the end: a stop or a kill came after the last step's checkpoint
        # but before that epoch's validation, which is then run here (train_epoch takes no step).
        while self.iteration < self.total_steps or self.state.step_in_epoch > 0:
            stats = self.train_epoch()
            t0 = time.time()
            val = self.validate()
            self.run_log.epoch(stats, val, time.time() - t0, self.state.epoch, self.iteration)
            self.skill()
            self.last_val = val
            self.state.next_epoch()
            # The checkpoint of an epoch's last step, and of the run's, is written after the
            # validation (train_epoch leaves it here): once, and a resume from it knows the
            # validation is done.
            if self.checkpoint_due() or self.iteration >= self.total_steps:
                self.save_checkpoint()
        if val is None and self.checkpointer.written_for(self.iteration) is None:
            self.save_checkpoint()  # (a run with no step to take)
        wall_s = time.time() - t_start  # the report's passes below are not training
        if self.cfg.throughput_report:  # after the final checkpoint; puts the state back
            throughput_report.run(self)
        self.run_log.close()
        self.loaders.close()
        log.info(f"Done: {self.iteration} steps, checkpoints in {self.ckpt_dir}")
        self.run_log.summary(wall_s, val, self.iteration)

    def close(self, at_once: bool = False):
        """The run is over: its loaders and data waits end. ``at_once`` (a peer or a loader
        failed, and joining the loader workers could hang): only what the run shows is
        flushed, and the process exits next."""
        if at_once:
            self.run_log.close()
            return
        self.loaders.close()
        self.stopper.close()


def run(cfg, trainer_cls=Trainer):
    """Train under ``cfg``. How the run ends, every way (trained; a stop signal: the checkpoint,
    the resume line and exit code 3; one error line and its exit code), is engine.stop's
    RunEnding: from here on a stop signal stops cleanly."""
    with RunEnding(cfg) as end:
        check_torch_version()
        end.rt = setup_runtime(cfg)
        try:
            end.trainer = trainer_cls(cfg, end.rt, end)
        except RunFinished as finished:  # its one line, exit code 0
            log.info(finished)
            return
        end.trainer.fit()


if __name__ == "__main__":
    run(COMMAND_LINE_CONFIG)
