"""What a checkpoint holds, and how a run is put back exactly where it stopped: ``TrainState``,
the loop's position and everything with state of its own in the serial layout (loading on any
layout), with every rank's RNG streams."""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint import files
from settings.config import CONFIG_CLASSES, to_dict
from settings.errors import ConfigError, TrainingError, on_every_rank

log = files.log  # the package's one logger


def setting_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(allowed, refused) changes from the checkpoint's settings to this run's, as ``"key old ->
    new"``: allowed where the field's metadata says ``resume=True`` (docs/errors.md, "Resuming with
    changed settings"); settings one side does not know, and how it was resumed, skipped."""
    may_change = {f.name for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls)
                  if f.metadata.get("resume")}
    allowed, refused = [], []
    for key in sorted(saved.keys() & current.keys() - {"resume", "resume_from"}):
        if saved[key] != current[key]:
            change = f"{key} {saved[key]} -> {current[key]}"
            (allowed if key in may_change else refused).append(change)
    return allowed, refused


def resume_changes(state: dict, path: str, cfg, global_batch: int) -> list[str]:
    """The allowed setting changes from the checkpoint ``state`` to ``cfg``; others are refused."""
    if state.get("config", {}).get("model", cfg.model) != cfg.model:
        raise on_every_rank(ConfigError(
            f"{path} was written by a {state['config']['model']} run; this is a {cfg.model} "
            f"config: resume with the config that wrote it"))
    allowed, refused = setting_changes(state.get("config", {}), to_dict(cfg))
    saved_batch = state.get("global_batch", global_batch)
    if saved_batch != global_batch:
        refused.append(f"global batch {saved_batch} -> {global_batch}")
    if refused:
        raise on_every_rank(ConfigError(
            f"{path} was written with other settings: {'; '.join(refused)}. Resume with the "
            f"checkpoint's values (config.yaml in its run directory), or start a new run from its "
            f"weights: --init_from {path} (step 0, a new optimizer and schedule)"))
    return allowed


def keep_run_length(cfg, saved: dict):
    """``cfg`` with the run length of the checkpoint's run (``saved``: its settings) unless this
    command gives one (a finished run stays finished, whatever the YAML's ``num_epochs`` says)."""
    given = getattr(cfg, "command_line", frozenset())
    run_length = ("num_epochs", "num_iters")
    length = {k: saved[k] for k in run_length if k in saved}
    if given & set(run_length) or len(length) < len(run_length) or \
            all(getattr(cfg, k) == v for k, v in length.items()):
        return cfg
    kept = dataclasses.replace(cfg, **length)
    kept.command_line = given
    return kept


class TrainState:
    def __init__(self, model, sharding, optimizer, scaler, scheduler, rt, cfg, steps_per_epoch):
        self.model, self.sharding = model, sharding
        self.optimizer, self.scaler, self.scheduler = optimizer, scaler, scheduler
        self.rt, self.cfg, self.steps_per_epoch = rt, cfg, steps_per_epoch
        self.iteration = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.step_in_epoch = 0  # steps taken in the current epoch
        self.epoch_loss_carry = 0.0  # the current epoch's summed step losses before a resume
        # This rank's loss and grad norm sums and steps since the last log point, from the
        # checkpoint: the next log point averages the same steps as an uninterrupted run's.
        self.window_carry = (0.0, 0.0, 0)

    def next_epoch(self):
        self.epoch += 1
        self.step_in_epoch = 0
        self.epoch_loss_carry = 0.0

    def state_dict(self, epoch_loss_sum: float, window=(0.0, 0.0, 0)) -> dict | None:
        """Collective: the checkpoint's contents on rank 0, None elsewhere (under FSDP alone without
        the model and optimizer: their shards). ``epoch_loss_sum``: the epoch's summed losses so
        far; ``window``: this rank's (loss sum, grad norm sum, steps) since the last log point."""
        rt = self.rt
        carried = self.epoch_loss_carry + epoch_loss_sum
        if not math.isfinite(carried):
            raise TrainingError(f"the training loss is not finite at step {self.iteration}; not "
                                f"writing a checkpoint. Lower lr or check the data; earlier "
                                f"checkpoints are kept")
        # Torch, CUDA, numpy and Python RNG states, in types that weights_only loading accepts
        _, keys, pos, has_gauss, cached = np.random.get_state()
        version, py_state, gauss = random.getstate()
        mine = ({"torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                 "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached": float(cached)},
                 "python": {"version": version, "state": list(py_state), "gauss": gauss}},
                tuple(window))
        per_rank = [mine]
        if rt.distributed:
            per_rank = [None] * rt.world_size
            dist.all_gather_object(per_rank, mine)  # every rank's dropout stream and window
        saved = {}
        if not self.sharding.writes_shards:  # collective: tensor by tensor, rank 0 keeps them
            saved = {"model": self.sharding.model_state(self.model, rt.is_main),
                     "optimizer": self.sharding.optimizer_state(self.model, self.optimizer,
                                                                rt.is_main)}
        if not rt.is_main:
            return None
        return saved | {
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "iteration": self.iteration,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "epoch_loss_sum": carried,
            "steps_per_epoch": self.steps_per_epoch,
            "rng": [rng for rng, _ in per_rank],
            "loss_window": [w for _, w in per_rank],
            "config": to_dict(self.cfg),
            "world_size": rt.world_size,
            "global_batch": rt.global_batch,
        }

    def load_state_dict(self, state: dict, path: str):
        """Restore everything ``state_dict`` wrote (``path``: for errors and logs)."""
        for change in resume_changes(state, path, self.cfg, self.rt.global_batch):
            log.info(f"resume: {change}")
        if state["steps_per_epoch"] != self.steps_per_epoch:
            raise ConfigError(f"the checkpoint {path} has {state['steps_per_epoch']} steps per "
                              f"epoch but this run has {self.steps_per_epoch}: resume with the "
                              f"same data and global batch size")
        try:
            # A directory of shards (an FSDP run's): under FSDP alone each rank reads its own
            # shards (collective), on any other layout the whole tensors, as of a .pt file.
            if "dcp" in state and self.sharding.writes_shards:
                state = state | files.shards(self.model, self.optimizer, state["dcp"])
            elif "dcp" in state:
                state = state | files.read_tensors(state["dcp"])
            self.sharding.load_model_state(self.model, state["model"])
            self.sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        except (KeyError, ValueError, RuntimeError, files.CheckpointException) as e:
            raise ConfigError(f"{path} does not fit this model ({type(e).__name__}: {e}): resume "
                              f"with the config that wrote it") from None
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.iteration = state["iteration"]
        self.epoch = state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        self.epoch_loss_carry = state["epoch_loss_sum"]
        rng = state["rng"][self.rt.rank % len(state["rng"])]  # this rank's streams
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        n, p = rng["numpy"], rng["python"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
        windows = state.get("loss_window", [])
        if len(windows) == self.rt.world_size:  # (on other ranks: the next point averages less)
            self.window_carry = tuple(windows[self.rt.rank])
