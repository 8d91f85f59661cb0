"""Start from weights saved by the tutorial's own models (``init_from``).

What this reads: a model's ``state_dict()`` saved with ``torch.save`` (from under
DistributedDataParallel or ``torch.compile`` too), or a checkpoint dict holding one under
``model_state``, ``state_dict`` or ``model``. Its names and
layouts differ from ours in three places:

* ViT head: the tutorial orders each token's outputs as (p, p, C_out), ours as (C_out, p, p);
  the rows of ``head.weight`` (and ``head.bias``, if any) are permuted.
* ViT attention: a model with separate ``attn.q/k/v`` projections is concatenated into our
  ``attn.qkv`` ([q | k | v]); the tutorial's fused ``attn.qkv`` is already in our layout.
* U-Net: ``conv_down{i}.0`` / ``conv_up{i}.0`` / ``conv_last`` are our ``down.{i-1}.0`` /
  ``up.{levels-i}.0`` / ``last``.
"""
from __future__ import annotations

import re

import torch

from settings.errors import ConfigError

_WRAPPERS = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


def _strip(name: str) -> str:
    while name.startswith(_WRAPPERS):
        name = name.split(".", 1)[1]
    return name


def vit_from_reference(sd: dict, patch_size: int, out_chans: int) -> dict:
    out = {}
    for name, t in sd.items():
        m = re.fullmatch(r"(.*attn\.)([qkv])\.(weight|bias)", name)
        if m:
            if m.group(2) == "q":  # [q | k | v] along the output dimension
                out[f"{m.group(1)}qkv.{m.group(3)}"] = torch.cat(
                    [sd[f"{m.group(1)}{x}.{m.group(3)}"] for x in "qkv"])
            continue
        if name in ("head.weight", "head.bias") and t.shape[0] == out_chans * patch_size ** 2:
            # rows (p, q, c) -> (c, p, q)
            t = t.reshape(patch_size, patch_size, out_chans, -1).permute(2, 0, 1, 3)
            t = t.reshape(out_chans * patch_size ** 2, *sd[name].shape[1:])
        out[name] = t
    return out


def unet_from_reference(sd: dict, levels: int) -> dict:
    out = {}
    for name, t in sd.items():
        m = re.fullmatch(r"conv_(down|up)(\d+)\.0\.(weight|bias)", name)
        if m:
            i = int(m.group(2))
            name = f"down.{i - 1}.0.{m.group(3)}" if m.group(1) == "down" \
                else f"up.{levels - i}.0.{m.group(3)}"
        elif name.startswith("conv_last."):
            name = "last." + name[len("conv_last."):]
        out[name] = t
    return out


def load_reference_weights(model: torch.nn.Module, path: str, from_reference) -> None:
    """Copy the weights of a tutorial model saved at ``path`` into the serial ``model`` (before
    any sharding), renamed by ``from_reference(sd, model)`` (the task's). Every parameter must be
    matched: a missing, extra or differently shaped tensor is a ``ConfigError`` naming it."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"init_from={path}: no such file") from None
    except Exception as e:
        raise ConfigError(f"init_from={path} is not a saved state dict ({type(e).__name__}: "
                          f"{e}): save the tutorial model's state_dict() with torch.save") from None
    if not isinstance(sd, dict):
        raise ConfigError(f"init_from={path} holds a {type(sd).__name__}, not a state dict: save the "
                          f"tutorial model's state_dict() with torch.save")
    if isinstance(sd.get("model"), dict) and "config" in sd and "iteration" in sd:
        # this project's own checkpoint: its weights are in this model's layout already, and
        # the task's renaming (vit_from_reference: the head's rows) would scramble them
        raise ConfigError(f"init_from={path} is a checkpoint of this project, not the tutorial's "
                          f"weights: continue its run with --resume_from {path}")
    for key in ("model_state", "state_dict", "model"):  # a state dict inside a larger record
        if isinstance(sd.get(key), dict):
            sd = sd[key]
    sd = {_strip(k): v for k, v in sd.items()}
    sd = from_reference(sd, model)
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    shapes = [f"{k} {tuple(sd[k].shape)} (this model: {tuple(own[k].shape)})"
              for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or extra or shapes:
        hint = (" (the tutorial's ViT head has no bias: set head_bias false)"
                if missing == ["head.bias"] else "")
        raise ConfigError(f"init_from={path} does not fit this model: missing {missing}, "
                          f"unexpected {extra}, shapes {shapes}{hint}; use the model settings "
                          f"the weights were trained with")
    model.load_state_dict(sd)
