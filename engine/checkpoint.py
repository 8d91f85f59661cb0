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
import shutil
import warnings

import numpy as np
import torch

from settings.errors import TrainingError

log = logging.getLogger(__name__)
MB = 1e6

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
    """Write ``state`` as the checkpoint of ``iteration`` and drop all but the newest ``keep``.
    A failed write (full disk, quota, an unwritable directory) raises TrainingError naming the
    path and the space needed, and leaves the existing checkpoints as they were."""
    final = path_for(directory, iteration)
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic on POSIX file systems
    except (OSError, RuntimeError) as e:  # torch's serializer reports a failed write as either
        raise TrainingError(_write_failure(directory, final, state, e)) from None
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


def state_nbytes(obj) -> int:
    """Bytes of the tensors in a (nested) checkpoint state: about the size of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def _write_failure(directory: str, final: str, state: dict, exc: BaseException) -> str:
    """One line: what failed, the space a checkpoint needs and the space there is, the newest
    checkpoint that is kept, and what to do."""
    previous = list_checkpoints(directory) if os.path.isdir(directory) else []
    need = os.path.getsize(previous[0]) if previous else state_nbytes(state)
    try:
        free = f"{shutil.disk_usage(directory).free / MB:.1f} MB free there"
    except OSError:
        free = "free space unknown"
    # torch's serializer reports a failed write as a RuntimeError about stream positions
    reason = getattr(exc, "strerror", None) or "the write stopped part-way: a full disk, a " \
        "quota or a file size limit"
    kept, then = (f"the newest checkpoint {previous[0]} is kept", "resume with --resume") \
        if previous else ("there is no earlier checkpoint", "run again")
    return (f"cannot write the checkpoint {final} ({reason}): it needs about {need / MB:.1f} MB, "
            f"{free}; {kept}. Free space, or make the directory writable, or choose another "
            f"--expdir, then {then}")


def load_file(path: str, map_location="cpu"):
    """(state, path) if the file loads and holds every expected entry, else (None, None)."""
    try:
        with warnings.catch_warnings():  # torch's "please file an issue" about odd pickles
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated or corrupt file
        log.warning(f"skipping unreadable checkpoint {path}: {_unreadable(e)}")
        return None, None
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        log.warning(f"skipping checkpoint {path}: missing {missing}")
        return None, None
    return state, path


def _unreadable(exc: Exception) -> str:
    """Why a file did not load, in one line. torch's own text may run to paragraphs (for bytes
    that are no checkpoint, the weights-only unpickler's advice to load untrusted files with
    ``weights_only=False`` and to file an issue): only its first sentence is kept, and none of
    that advice."""
    what = "it is not a complete checkpoint (damaged, cut short, or not written by torch.save)"
    text = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(exc)).strip()
    if not text or "weights only load failed" in text.lower():
        return f"{what}: {type(exc).__name__}"
    return f"{what}: {type(exc).__name__}: {text.splitlines()[0].split('. ')[0][:160]}"


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
