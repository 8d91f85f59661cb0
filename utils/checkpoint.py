"""Checkpoints written atomically, the newest K kept, loaded with ``weights_only=True``.

A checkpoint is written to a temporary file in the same directory, flushed to disk, and renamed
into place: a crash mid-write leaves at worst a stray ``.tmp`` file, never a file under a
checkpoint name that loads wrongly. Loading walks from the newest checkpoint to older ones and
takes the first that loads and holds every expected entry.
"""
from __future__ import annotations

import glob
import logging
import os
import random
import re

import numpy as np
import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"ckpt_(\d{8})\.pt$")
REQUIRED = ("model", "optimizer", "scaler", "scheduler", "iteration", "epoch", "step_in_epoch",
            "rng", "config")


def path_for(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"ckpt_{iteration:08d}.pt")


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files, newest (highest iteration) first."""
    files = [f for f in glob.glob(os.path.join(directory, "ckpt_*.pt")) if _NAME.search(f)]
    return sorted(files, key=lambda f: int(_NAME.search(f).group(1)), reverse=True)


def save(directory: str, iteration: int, state: dict, keep: int) -> str:
    os.makedirs(directory, exist_ok=True)
    final = path_for(directory, iteration)
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic on POSIX file systems
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[keep:]:
        os.remove(old)
    return final


def load_file(path: str, map_location="cpu"):
    """(state, path) if the file loads and holds every expected entry, else (None, None)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated or corrupt file
        log.warning(f"skipping unreadable checkpoint {path}: {type(e).__name__}: {e}")
        return None, None
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        log.warning(f"skipping checkpoint {path}: missing {missing}")
        return None, None
    return state, path


def load_latest(directory: str, map_location="cpu"):
    """(state, path) of the newest checkpoint that loads, or (None, None) when there is none."""
    for path in list_checkpoints(directory):
        state, path = load_file(path, map_location)
        if state is not None:
            return state, path
    return None, None


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Torch, CUDA, numpy and Python RNG states in types that ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
    }


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
