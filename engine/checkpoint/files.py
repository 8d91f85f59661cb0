"""The checkpoint's two forms on disk: ``ckpt_<step>.pt``, the whole state in the serial layout,
written by rank 0; ``ckpt_<step>.dcp/``, an FSDP run's DCP directory (each rank its shards, rank 0
the metadata and ``train_state.pt``: the rest). Written atomically (a crash leaves at worst a
stray file, which ``clean_leftovers`` puts right), the newest K kept, checked whole."""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from engine.sharding import resharded
from settings.errors import TrainingError

log = logging.getLogger("engine.checkpoint")  # the package's one logger
MB = 1e6

_NAME = re.compile(r"ckpt_(\d{8})\.(pt|dcp)$")
# What an interrupted write leaves: write_file's temporary file, save's temporary DCP directory,
# and the step's earlier DCP checkpoint that save sets aside to write it again.
_LEFTOVER = re.compile(r"ckpt_\d{8}\.(pt\.\d+\.tmp|dcp\.tmp|dcp\.old)")
REQUIRED = ("model", "optimizer", "scaler", "scheduler", "iteration", "epoch", "step_in_epoch",
            "rng", "config")
TENSORS = ("model", "optimizer")  # what a DCP directory holds in shards; the rest is TRAIN_STATE
TRAIN_STATE = "train_state.pt"


def path_for(directory: str, iteration: int, sharded: bool = False) -> str:
    return os.path.join(directory, f"ckpt_{iteration:08d}.{'dcp' if sharded else 'pt'}")


def written_for(directory: str, iteration: int) -> str | None:
    """The checkpoint of ``iteration`` in ``directory``, of either form, or None."""
    forms = (path_for(directory, iteration, sharded) for sharded in (False, True))
    return next(filter(os.path.exists, forms), None)


def is_sharded(path: str) -> bool:
    """Whether ``path`` names a DCP checkpoint directory (``ckpt_<step>.dcp``)."""
    match = _NAME.search(path.rstrip(os.sep))
    return os.path.isdir(path) and match is not None and match.group(2) == "dcp"


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoints (files and DCP directories), newest (highest iteration) first."""
    found = [f for f in glob.glob(os.path.join(directory, "ckpt_*")) if _NAME.search(f)]
    return sorted(found, key=lambda f: int(_NAME.search(f).group(1)), reverse=True)


def _remove(path: str):
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _fsync_dir(directory: str):  # makes a rename in it durable
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_file(final: str, state: dict):
    """``torch.save(state)`` to ``final`` through a flushed temporary file renamed into place."""
    directory = os.path.dirname(os.path.abspath(final))
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # atomic on POSIX file systems
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


class WriteFailed(TrainingError):
    """A failed checkpoint write, in one line; ``rank``: where DCP reports another rank's failure."""

    def __init__(self, line: str, rank: int | None = None):
        super().__init__(line)
        self.rank = rank


def save(directory: str, iteration: int, state: dict | None, keep: int, shards: dict | None = None,
         is_main: bool = True) -> str:
    """Write the checkpoint of ``iteration``, keeping the newest ``keep``: ``state`` as one file;
    with ``shards`` (collective), those with DCP, each rank its own file, and ``state`` (rank 0's)
    as ``train_state.pt``, into ``ckpt_<iteration>.dcp``, renamed into place by rank 0. A failed
    write raises WriteFailed (on every rank for a shard write, on rank 0 alone for its own part)
    and leaves the existing checkpoints as they were."""
    final = path_for(directory, iteration, sharded=shards is not None)
    tmp = f"{final}.tmp"  # the same name on every rank (they share the directory)
    try:
        if shards is None:
            write_file(final, state)
        else:  # (collectives inside: a failure on any rank is a CheckpointException on every rank)
            dcp.save(shards, checkpoint_id=tmp)
        if is_main and shards is not None:
            write_file(os.path.join(tmp, TRAIN_STATE), state)
            old = f"{final}.old"
            if os.path.exists(final):  # the same step written again (after its validation)
                os.replace(final, old)
            os.replace(tmp, final)  # atomic on POSIX file systems
            _fsync_dir(directory)
            if os.path.exists(old):
                shutil.rmtree(old)
        for stale in list_checkpoints(directory)[keep:] if is_main else []:
            _remove(stale)
    except CheckpointException as e:  # (a BaseException) every rank has left dcp.save
        rank, (cause, _) = min(e.failures.items(), default=(None, (e, None)))
        failure = WriteFailed(_write_failure(directory, final, shards, cause), rank)
    except (OSError, RuntimeError) as e:  # (torch's serializer reports a failed write as either)
        failure = WriteFailed(_write_failure(directory, final, shards or state, e))
    else:
        return final
    if is_main and shards is not None:  # no rank writes there any more: the temporary directory
        with contextlib.suppress(OSError):  # goes, a set-aside checkpoint of this step comes back
            clean_leftovers(directory)
    raise failure


def clean_leftovers(directory: str):
    """Put right what interrupted writes left in ``directory`` (docs/preemption.md), while no rank
    writes there; nothing else is touched. One line logged per thing done."""
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        match, path = _LEFTOVER.fullmatch(name), os.path.join(directory, name)
        if match is None or os.path.isdir(path) != match.group(1).startswith("dcp"):
            continue
        if match.group(1) == "dcp.old" and not os.path.exists(path.removesuffix(".old")):
            os.replace(path, path.removesuffix(".old"))
            log.info(f"restored the checkpoint {path.removesuffix('.old')} from {name}, set "
                     f"aside by an interrupted checkpoint write")
        else:
            _remove(path)
            log.info(f"removed {path}, left by an interrupted checkpoint write")


def state_nbytes(obj) -> int:
    """Bytes of the tensors in a (nested) checkpoint state: about the size of its file."""
    if isinstance(obj, (dict, list, tuple)):
        return sum(map(state_nbytes, obj.values() if isinstance(obj, dict) else obj))
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


def _write_failure(directory: str, final: str, state: dict, exc: BaseException) -> str:
    """One line: what failed, the space needed and free, the newest checkpoint kept, what to do."""
    previous = list_checkpoints(directory)  # (none where the directory is missing)
    need = state_nbytes(state)
    if previous and os.path.isdir(previous[0]):
        need = sum(os.path.getsize(os.path.join(previous[0], f)) for f in os.listdir(previous[0]))
    elif previous:
        need = os.path.getsize(previous[0])
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


def load_file(path: str):
    """(state, path) if the checkpoint loads whole, else (None, None) and a warning line saying
    why; a DCP directory's holds ``"dcp": path`` in place of the tensors, read later."""
    sharded, file = os.path.isdir(path), path
    try:
        if sharded:  # the metadata and every shard file, whole, then train_state.pt
            ends = {}  # each shard file's length, as the metadata says
            for info in FileSystemReader(path).read_metadata().storage_data.values():
                ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                               info.offset + info.length)
            short = [f for f, n in ends.items() if not os.path.isfile(os.path.join(path, f))
                     or os.path.getsize(os.path.join(path, f)) < n]
            if short:
                raise OSError(f"shard files missing or cut short: {sorted(short)}")
            file = os.path.join(path, TRAIN_STATE)
        state = read_pt(file, mmap=True)
    except Exception as e:  # an incomplete directory, a truncated or corrupt file
        log.warning(f"skipping unreadable checkpoint {file}: {unreadable(e)}")
        return None, None
    missing = [k for k in REQUIRED if k not in state and not (sharded and k in TENSORS)]
    if missing:
        log.warning(f"skipping checkpoint {file}: missing {missing}")
        return None, None
    return (state | {"dcp": path} if sharded else state), path


def read_pt(path: str, mmap: bool = False):
    """What ``torch.save`` wrote to ``path``, in types ``weights_only`` loading accepts; ``mmap``:
    mapped (a rank then reads only the pages of the slices it takes)."""
    with warnings.catch_warnings():  # torch's "please file an issue" about odd pickles
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def unreadable(exc: Exception) -> str:
    """Why a file did not load, in one line: torch's first sentence, without its advice."""
    what = "it is not a complete checkpoint (damaged, cut short, or not written by torch.save)"
    text = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(exc)).strip()
    if not text or "weights only load failed" in text.lower():
        return f"{what}: {type(exc).__name__}"
    return f"{what}: {type(exc).__name__}: {text.splitlines()[0].split('. ')[0][:160]}"


def read_tensors(path: str, keys=None) -> dict:
    """A DCP checkpoint's whole tensors (``keys``' only, when given) in this process alone."""
    # torch (to 2.13 at least) has no public call that fills an empty state dict from a DCP
    # checkpoint; this is what its own ``format_utils.dcp_to_torch_save`` does.
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    tensors = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(path),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return tensors


def shards(model, optimizer, path: str | None = None) -> dict:
    """This rank's shards of an FSDP model's weights and Adam state, as DCP saves and reads them;
    with ``path``, collective: read from that DCP checkpoint (of any number of ranks)."""
    model_state, optimizer_state = get_state_dict(resharded(model), optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if path is not None:
        dcp.load(state, checkpoint_id=path)
    return state


def weights(state: dict) -> dict:
    """The model's weights, in the serial layout, of a checkpoint ``load_file`` loaded."""
    return read_tensors(state["dcp"], keys={"model"})["model"] if "dcp" in state \
        else state["model"]


def load_latest(directory: str):
    """(state, path) of the newest checkpoint that loads, or (None, None) when there is none."""
    for path in list_checkpoints(directory):
        state, path = load_file(path)
        if state is not None:
            return state, path
    return None, None
