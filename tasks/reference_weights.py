"""The weights of the tutorial's own models under this project's names and layouts
(``init_from``; ``engine.start_weights`` reads them): how they differ is in docs/checkpoints.md
("Starting from saved weights")."""
from __future__ import annotations

import re

import torch

from settings.errors import ConfigError


def vit_from_reference(sd: dict, patch_size: int, out_chans: int) -> dict:
    out = {}
    for name, t in sd.items():
        m = re.fullmatch(r"(.*attn\.)([qkv])\.(weight|bias)", name)
        if m:
            if m.group(2) == "q":  # [q | k | v] along the output dimension
                parts = [f"{m.group(1)}{x}.{m.group(3)}" for x in "qkv"]
                if not all(p in sd for p in parts):
                    raise ConfigError(f"{name} has no {' and '.join(p for p in parts if p not in sd)} "
                                      f"beside it: give the whole model's state_dict()")
                out[f"{m.group(1)}qkv.{m.group(3)}"] = torch.cat([sd[p] for p in parts])
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
