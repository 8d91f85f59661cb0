"""The checkpointer: the one object the training loop asks about checkpoints."""
from __future__ import annotations

import collections
import os
import time

import torch
import torch.distributed as dist

from engine.checkpoint import files
from engine.checkpoint.state import TrainState, keep_run_length, resume_changes
from engine.checkpoint.start_weights import load_start_weights
from settings.errors import ConfigError, TrainingError, on_every_rank

log = files.log  # the package's one logger


# The checkpoint a run continues from, which every rank has read: its contents (a DCP
# directory's without the tensors), path, and settings (the run length its run had unless the
# command gives one).
Resume = collections.namedtuple("Resume", "state path cfg")


class RunFinished(Exception):
    """Resumed with every step taken and the last validation done: the line saying so, exit 0."""


class Checkpointer:
    """The checkpoints of the run of ``cfg`` in ``directory`` on the ranks of ``rt``: which to
    resume (before the model is built), its state loaded, a step's checkpoint saved."""

    def __init__(self, directory: str, cfg, rt):
        self.directory, self.cfg, self.rt = directory, cfg, rt
        self.resumed = None  # the Resume that ``resume`` chose, or None for a fresh run
        self.state = None  # the run's TrainState, made by ``load``

    def resume(self) -> Resume | None:
        """The checkpoint to continue from (``--resume``, ``--resume_from``), or None for a fresh
        run; RunFinished for a finished one. Rank 0 chooses, the others load exactly its choice
        (docs/preemption.md says why)."""
        rt = self.rt
        choice = None  # (state, path), None for a fresh run, or the ConfigError every rank raises
        if rt.is_main:
            try:
                choice = self._choose()
            except ConfigError as e:
                choice = on_every_rank(e)
        sent = [choice[1] if isinstance(choice, tuple) else choice]
        if rt.distributed:
            # Rank 0's choice to all: the path, None for a fresh run, or the error all raise.
            dist.broadcast_object_list(sent, src=0, group=rt.host_group)
        if isinstance(sent[0], ConfigError):
            raise sent[0]
        if sent[0] is None:
            return None
        if rt.distributed:
            if not rt.is_main:
                choice = files.load_file(sent[0])
            loaded = [None] * rt.world_size
            # Whether the chosen checkpoint loaded on every rank: all go on with it, or all raise.
            dist.all_gather_object(loaded, choice[0] is not None, group=rt.host_group)
            if not all(loaded):
                rank = loaded.index(False)
                raise on_every_rank(ConfigError(
                    f"rank {rank} cannot load {sent[0]}, the checkpoint rank 0 chose to resume "
                    f"from (rank {rank}'s warning line says why): every rank must see the same "
                    f"files; check the file system they share, or move that checkpoint aside to "
                    f"resume from the one before"))
        state, path = choice
        cfg = self.cfg = keep_run_length(self.cfg, state.get("config", {}))
        per_epoch = state.get("steps_per_epoch")  # (every step taken, the last validation done)
        if per_epoch is not None and state["step_in_epoch"] == 0 \
                and state["iteration"] >= (cfg.num_iters or cfg.num_epochs * per_epoch):
            if os.path.realpath(os.path.dirname(path.rstrip(os.sep))) != \
                    os.path.realpath(self.directory):  # --resume_from
                raise on_every_rank(ConfigError(
                    f"--resume_from {cfg.resume_from}: that run has finished its "
                    f"{state['iteration']} steps, so run {cfg.run_num} would train nothing: add a "
                    f"larger --num_epochs or --num_iters to train on from it"))
            resume_changes(state, path, cfg, rt.global_batch)  # (refused ones said first)
            raise RunFinished(f"Nothing to do: run {cfg.run_num} has finished its "
                              f"{state['iteration']} steps (checkpoint {path}). To train longer, "
                              f"resume with a larger --num_epochs or --num_iters (the "
                              f"learning-rate schedule then spans the new total)")
        self.resumed = Resume(state, path, cfg)
        return self.resumed

    def _choose(self):
        """Rank 0's part of ``resume`` (``--resume auto``: this run directory's newest checkpoint,
        else a fresh run; a fresh run over one that holds checkpoints is refused)."""
        cfg, ckpt_dir = self.cfg, self.directory
        run_dir = os.path.dirname(ckpt_dir)
        files.clean_leftovers(ckpt_dir)
        existing = files.list_checkpoints(ckpt_dir)
        auto = cfg.resume == "auto" and existing  # (then the newest, as --resume takes)
        if cfg.resume_from and not auto:
            if existing:
                raise ConfigError(f"--resume_from: {run_dir} already holds checkpoints: use "
                                  f"--resume to continue it, or choose another --run_num")
            src = cfg.resume_from
            if os.path.isdir(os.path.join(src, "checkpoints")):
                src = os.path.join(src, "checkpoints")
            if os.path.isfile(src) or files.is_sharded(src):
                state, path = files.load_file(src)
            elif os.path.isdir(src):
                state, path = files.load_latest(src)
            else:
                raise ConfigError(f"--resume_from {src}: no such file or directory")
            if state is None:
                raise ConfigError(f"--resume_from {src}: no checkpoint there loads")
            return state, path
        if cfg.resume is not True and not auto:  # false, or auto with nothing to continue
            if existing:
                raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume to "
                                  f"continue that run, or choose another --run_num")
            return None
        if not existing:
            raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}: check --config, "
                              f"--run_num, --expdir and the number of ranks "
                              f"({self.rt.world_size}), or use --resume_from PATH")
        state, path = files.load_latest(ckpt_dir)
        if state is None:
            raise ConfigError(f"--resume: none of the checkpoints in {self.directory} loads "
                              f"(each is damaged or cut short; the log above names why): resume "
                              f"from a copy you kept with --resume_from PATH, or start a new "
                              f"run without --resume")
        return state, path

    def start_weights(self, model, from_reference):
        """``--init_from``: a fresh run's ``model`` from saved weights (``start_weights``). Every
        rank reads the file; all go on or all raise."""
        if self.cfg.init_from and self.resumed is None:
            failure = line = None
            try:
                line = load_start_weights(model, self.cfg.init_from, from_reference, self.cfg)
            except ConfigError as e:
                failure = (self.rt.rank, str(e))
            self.rt.raise_first_failure(failure, ConfigError)
            log.info(line)

    def load(self, model, sharding, optimizer, scaler, scheduler,
             steps_per_epoch: int) -> TrainState:
        """The run's state: at step 0, or put back from the checkpoint ``resume`` chose."""
        self.state = st = TrainState(model, sharding, optimizer, scaler, scheduler, self.rt,
                                     self.cfg, steps_per_epoch)
        if self.resumed is not None:
            st.load_state_dict(self.resumed.state, self.resumed.path)
            log.info(f"Resumed from {self.resumed.path} at step {st.iteration} (epoch "
                     f"{st.epoch + 1}, step {st.step_in_epoch} of {st.steps_per_epoch})")
        return st

    def save(self, epoch_sum: torch.Tensor | None, window: tuple) -> float:
        """Collective: write the checkpoint of the step just taken (the newest ``checkpoint_keep``
        kept) and return its seconds; a write failed on any rank raises TrainingError on all.
        ``epoch_sum``: this rank's summed losses of the epoch so far (None at its end)."""
        t0 = time.perf_counter()
        rt, st, keep = self.rt, self.state, self.cfg.checkpoint_keep
        # Host sync and one collective: the epoch's losses so far, over the data-parallel ranks
        carried = 0.0 if epoch_sum is None else rt.dp_sum(epoch_sum.clone().float()).item()
        path, failure = None, None
        try:  # (state_dict: collective, its contents on rank 0)
            state = st.state_dict(carried, window)
            if (sharded := st.sharding.writes_shards) or rt.is_main:  # (FSDP alone: all write)
                shards = files.shards(st.model, st.optimizer) if sharded else None
                path = files.save(self.directory, st.iteration, state, keep, shards, rt.is_main)
        except files.WriteFailed as e:
            failure = (rt.rank if e.rank is None else e.rank, str(e))
        # (the exchange also holds every rank until rank 0 has put the checkpoint in place)
        rt.raise_first_failure(failure, TrainingError)
        if rt.is_main:
            log.info(f"Checkpoint written: {path} ({time.perf_counter() - t0:.2f} s)")
        return time.perf_counter() - t0

    def written_for(self, step: int) -> str | None:
        return files.written_for(self.directory, step)

    def kept(self) -> str:
        """For the line of a run that ends without writing: what it leaves to resume from."""
        kept = files.list_checkpoints(self.directory)
        if not kept:
            return "Nothing was written; the run has no checkpoint yet"
        return (f"Nothing was written: the newest checkpoint, {kept[0]}, is kept (continue with "
                f"--resume auto)")

    def reload(self):
        """Collective: the run's state put back from its newest checkpoint (after the trials)."""
        state, path = files.load_latest(self.directory)
        if state is None:
            raise TrainingError(f"cannot put the training state back: no checkpoint in "
                                f"{self.directory} loads")
        self.state.load_state_dict(state, path)
