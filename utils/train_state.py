"""What a checkpoint holds, and how a run is put back exactly where it stopped.

``TrainState`` is the loop's position (step, epoch, step within the epoch, the epoch's summed
losses so far) plus references to everything with state of its own: the model, the optimizer,
the gradient scaler and the LR schedule. ``state_dict`` gathers all of it in the serial layout
(keyed by parameter name, so a checkpoint loads on any number of ranks and any tp/cp layout)
together with every rank's RNG streams; ``load_state_dict`` puts it back.
"""
from __future__ import annotations

import logging
import math

import torch.distributed as dist

from utils import checkpoint
from utils.config import to_dict
from utils.errors import ConfigError, TrainingError

log = logging.getLogger(__name__)


class TrainState:
    def __init__(self, model, sharding, optimizer, scaler, scheduler, rt, cfg, steps_per_epoch):
        self.model, self.sharding = model, sharding
        self.optimizer, self.scaler, self.scheduler = optimizer, scaler, scheduler
        self.rt, self.cfg, self.steps_per_epoch = rt, cfg, steps_per_epoch
        self.iteration = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.step_in_epoch = 0  # steps taken in the current epoch
        self.epoch_loss_carry = 0.0  # the current epoch's summed step losses before a resume

    def next_epoch(self):
        self.epoch += 1
        self.step_in_epoch = 0
        self.epoch_loss_carry = 0.0

    def state_dict(self, epoch_loss_sum: float) -> dict | None:
        """Collective on all ranks (RNG states are gathered, sharded tensors reassembled); the
        checkpoint's contents on rank 0, None elsewhere. ``epoch_loss_sum``: this epoch's summed
        step losses (over data-parallel ranks) so far, so a resumed epoch reports the same mean."""
        rt = self.rt
        carried = self.epoch_loss_carry + epoch_loss_sum
        if not math.isfinite(carried):
            raise TrainingError(f"the training loss is not finite at step {self.iteration}; not "
                                f"writing a checkpoint. Lower lr or check the data; earlier "
                                f"checkpoints are kept")
        rngs = [checkpoint.rng_state()]
        if rt.distributed:
            rngs = [None] * rt.world_size
            dist.all_gather_object(rngs, checkpoint.rng_state())  # every rank's dropout stream
        model_state = self.sharding.model_state(self.model)
        optimizer_state = self.sharding.optimizer_state(self.model, self.optimizer)
        if not rt.is_main:
            return None
        return {
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

    def load_state_dict(self, state: dict, path: str):
        """Restore everything ``state_dict`` wrote; ``path`` names the file in errors and logs."""
        if state.get("config", {}).get("model", self.cfg.model) != self.cfg.model:
            raise ConfigError(f"{path} was written by a {state['config']['model']} run; this is a "
                              f"{self.cfg.model} config: resume with the config that wrote it")
        if state["steps_per_epoch"] != self.steps_per_epoch:
            raise ConfigError(f"the checkpoint {path} has {state['steps_per_epoch']} steps per "
                              f"epoch but this run has {self.steps_per_epoch}: resume with the "
                              f"same data and global batch size")
        try:
            self.sharding.load_model_state(self.model, state["model"])
            self.sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{path} does not fit this model ({type(e).__name__}: {e}): resume "
                              f"with the config that wrote it") from None
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.iteration = state["iteration"]
        self.epoch = state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        self.epoch_loss_carry = state["epoch_loss_sum"]
        rngs = state["rng"]
        checkpoint.set_rng_state(rngs[self.rt.rank % len(rngs)])
        log.info(f"Resumed from {path} at step {self.iteration} (epoch {self.epoch + 1}, step "
                 f"{self.step_in_epoch} of {self.steps_per_epoch})")
