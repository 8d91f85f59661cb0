"""Start a new run from saved weights (``init_from``; docs/checkpoints.md): a checkpoint of this
project, or the tutorial's models' weights renamed by the task (``Task.from_reference``)."""
from __future__ import annotations

import os
import re

import torch

from engine.checkpoint import files
from engine.checkpoint.state import setting_changes
from settings.config import to_dict
from settings.errors import ConfigError

BATCH = ("global_batch_size", "local_batch_size")  # change what a new run learns


def _read(path: str):
    """(state dict, this project's checkpoint state or None) saved at ``path``."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ConfigError(f"init_from={path} is a directory but not a sharded checkpoint (it "
                              f"holds no .metadata): give a checkpoint (a ckpt_<step>.pt file or "
                              f"an FSDP run's ckpt_<step>.dcp directory) or a file of saved "
                              f"weights")
        state, _ = files.load_file(path)
        if state is None:
            raise ConfigError(f"init_from={path} does not load (incomplete or damaged; the line "
                              f"above says why): give an earlier checkpoint of that run")
        return files.weights(state), state
    try:
        sd = files.read_pt(path)
    except FileNotFoundError:
        raise ConfigError(f"init_from={path}: no such file") from None
    except Exception as e:
        raise ConfigError(f"init_from={path} does not load ({files.unreadable(e)}): give "
                          f"another checkpoint of that run, or the tutorial model's "
                          f"state_dict() saved with torch.save") from None
    if not isinstance(sd, dict):
        raise ConfigError(f"init_from={path} holds a {type(sd).__name__}, not a state dict: save the "
                          f"tutorial model's state_dict() with torch.save")
    if isinstance(sd.get("model"), dict) and "config" in sd and "iteration" in sd:
        return sd["model"], sd  # this project's checkpoint
    for key in ("model_state", "state_dict", "model"):  # a state dict inside a larger record
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    # the names without the prefixes of DistributedDataParallel and torch.compile
    return {re.sub(r"^((module|_orig_mod)\.)+", "", k): v for k, v in sd.items()}, None


def load_start_weights(model: torch.nn.Module, path: str, from_reference, cfg) -> str:
    """Copy the weights saved at ``path`` into the serial ``model`` of a new run of ``cfg``;
    returns the line saying where they came from (``from_reference(sd, model)``: the task's
    renaming of the tutorial's)."""
    sd, own = _read(path)
    differ = ""
    if own is None:
        try:
            sd = from_reference(sd, model)
        except ConfigError as e:
            raise ConfigError(f"init_from={path}: {e}") from None
        line = (f"Weights from {path}, read as a model of the tutorial's code (its names and "
                f"layouts turned into this model's; this project's weights come as a checkpoint)")
    else:
        saved = own.get("config", {})
        if saved.get("model", cfg.model) != cfg.model:
            raise ConfigError(f"init_from={path} holds the weights of a {saved['model']} "
                              f"model, and this run trains a {cfg.model} model: give a "
                              f"checkpoint of a {cfg.model} run")
        how, what = setting_changes(saved, to_dict(cfg, identity=False))
        how = [c for c in how if c.split()[0] not in ("init_from", "expdir", "run_num")]
        what += [c for c in how if c.split()[0] in BATCH]  # (a resume keeps the global batch)
        how = [c for c in how if c.split()[0] not in BATCH]
        differ = f"; that run's settings that differ: {', '.join(what)}" if what else ""
        line = (f"Weights from {path} (step {own['iteration']} of the run of config "
                f"{saved.get('name') or '?'}); a new run from step 0, with a new optimizer and "
                f"schedule. Settings that differ from that run: of what it learns: "
                f"{', '.join(what) or 'none'}; of how it runs: {', '.join(how) or 'none'}")
    own_sd = model.state_dict()
    missing, extra = sorted(set(own_sd) - set(sd)), sorted(set(sd) - set(own_sd))
    shapes = [f"{k} {tuple(sd[k].shape)} (this model: {tuple(own_sd[k].shape)})"
              for k in own_sd if k in sd and sd[k].shape != own_sd[k].shape]
    if missing or extra or shapes:
        found = [f"{len(names)} {kind}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                 for kind, names in (("of this model's tensors missing", missing),
                                     ("unexpected", extra), ("of other shapes", shapes)) if names]
        raise ConfigError(f"init_from={path} does not fit this model ({', '.join(found)})"
                          f"{differ}: use the model settings the weights were trained with")
    model.load_state_dict(sd)
    return line
