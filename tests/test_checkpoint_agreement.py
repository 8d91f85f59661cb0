"""Every checkpoint decision made once for all ranks, on real gloo ranks:

- resume: rank 0 chooses the checkpoint and every rank loads exactly that one (a rank whose
  listing is stale, or rank 0 seeing the newest damaged); a choice that does not load on one
  rank ends every rank with the same line naming that rank and the checkpoint;
- writes: a write that fails on one rank of 4 (rank 0's ``.pt`` file; under FSDP rank 2's
  shards, a CheckpointException, or rank 0's ``train_state.pt``) raises the same one-line
  TrainingError on every rank within seconds, and the previous checkpoint still loads;
- the leftovers of interrupted writes are cleaned (or, a set-aside ``.dcp.old``, taken back) at
  the next start, and nothing else is touched;
- ``python -m engine.checkpoint_convert`` refuses to overwrite its output and says when its
  input does not exist.

The resume scenarios use stand-in checkpoints (every expected entry, no weights); the write
failures train the tiny ViT of test_ddp for 2 steps with a checkpoint after each.
"""
import contextlib
import errno
import logging
import os
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from conftest import write_era5
from distributed_harness import run_ranks
from engine import checkpoint
from engine.checkpoint import start_weights
from engine.checkpoint_convert import main as convert_main
from engine.checkpoint import Checkpointer, files
from engine.runtime import Runtime, setup_runtime
from settings.errors import ConfigError, TrainingError
from test_ddp import vit_cfg
from train import Trainer

RANKS = 4
NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def stand_in(step: int, tensors: bool = True) -> dict:
    """A checkpoint's entries (what loading checks for), without weights."""
    state = {k: {} for k in checkpoint.REQUIRED} | {"iteration": step, "epoch": 0,
                                                    "step_in_epoch": step, "rng": []}
    return state if tensors else {k: v for k, v in state.items() if k not in checkpoint.TENSORS}


def write_dcp(directory: str, step: int) -> str:
    """A small sharded checkpoint, written by this one process."""
    with warnings.catch_warnings():  # DCP's "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        return checkpoint.save(directory, step, stand_in(step, tensors=False), keep=9,
                               shards={"model": {"w": torch.arange(4.0)}})


# ----------------------------------------------------------------------------- resume


def rank_resume(run_dir, scenarios):
    """Every rank: ``Checkpointer.resume`` under each scenario ``{name: (rank, view)}``, where
    that rank's view of the newest checkpoint is ``stale`` (not listed) or ``damaged`` (does
    not load); the step each rank resumes from, or its error."""
    rank = dist.get_rank()
    cfg = vit_cfg(os.path.join(run_dir, "no_data"), os.path.dirname(run_dir), resume="true")
    rt = setup_runtime(cfg)
    newest = checkpoint.path_for(os.path.join(run_dir, "checkpoints"), 4)
    listed, load = checkpoint.list_checkpoints, checkpoint.load_file
    views = {"stale": (files, "list_checkpoints", lambda d: [p for p in listed(d)
                                                             if p != newest]),
             "damaged": (files, "load_file", lambda p, *a: (None, None) if p == newest
                         else load(p, *a))}
    out = {}
    for name, (who, view) in scenarios.items():
        with mock.patch.object(*views[view]) if rank == who else contextlib.nullcontext():
            try:
                resume = Checkpointer(os.path.join(run_dir, "checkpoints"), cfg, rt).resume()
                state, path = resume.state, resume.path
                out[name] = (state["iteration"], path)
            except ConfigError as e:
                out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("resume") / "run")
    for step in (2, 4):
        checkpoint.save(os.path.join(run_dir, "checkpoints"), step, stand_in(step), keep=9)
    scenarios = {"rank2_stale": (2, "stale"), "rank0_damaged": (0, "damaged"),
                 "rank2_damaged": (2, "damaged")}
    results = run_ranks(rank_resume, RANKS, run_dir, scenarios, timeout=60, pg_timeout=30)
    return run_dir, results


def test_a_rank_with_a_stale_listing_resumes_from_rank_0s_choice(resumed):
    run_dir, results = resumed
    assert [r["rank2_stale"] for r in results] == \
        [(4, checkpoint.path_for(os.path.join(run_dir, "checkpoints"), 4))] * RANKS


def test_newest_damaged_on_rank_0_every_rank_takes_the_older(resumed):
    run_dir, results = resumed
    assert [r["rank0_damaged"] for r in results] == \
        [(2, checkpoint.path_for(os.path.join(run_dir, "checkpoints"), 2))] * RANKS


def test_choice_that_does_not_load_on_one_rank_ends_every_rank_with_one_line(resumed):
    run_dir, results = resumed
    lines = [r["rank2_damaged"] for r in results]
    assert len(set(lines)) == 1 and isinstance(lines[0], str), lines
    newest = checkpoint.path_for(os.path.join(run_dir, "checkpoints"), 4)
    assert lines[0].startswith(f"rank 2 cannot load {newest}, the checkpoint rank 0 chose")
    assert "\n" not in lines[0]


# ----------------------------------------------------------------------------- writes


class FailingWrite(Trainer):
    """Its rank ``fail_rank`` fails ``fail`` (as a full disk does) in step 2's checkpoint."""

    fail_rank, fail = 0, None

    def save_checkpoint(self, epoch_sum=None):
        if self.iteration != 2:
            return super().save_checkpoint(epoch_sum)
        self.save_started = time.monotonic()
        target = {"write_file": (files, "write_file"),
                  "write_data": (FileSystemWriter, "write_data")}[self.fail]
        failing = mock.patch.object(*target, side_effect=NO_SPACE)
        with failing if self.rt.rank == self.fail_rank else contextlib.nullcontext():
            return super().save_checkpoint(epoch_sum)


# (FSDP, the failing rank, what fails there, the checkpoint's form)
WRITE_FAILURES = {
    "pt_rank0": (False, 0, "write_file", "pt"),  # rank 0 writes the .pt file alone
    "dcp_shards_rank2": (True, 2, "write_data", "dcp"),  # DCP's CheckpointException on all
    "dcp_train_state_rank0": (True, 0, "write_file", "dcp"),  # rank 0's train_state.pt
}


def rank_write_failures(era5, expdir):
    """Every rank, each scenario of WRITE_FAILURES in turn: 2 steps, a checkpoint after each;
    the error this rank raised, how long after step 2's checkpoint began, the checkpoints
    directory."""
    out = {}
    for name, (fsdp, fail_rank, fail, _) in WRITE_FAILURES.items():
        cfg = vit_cfg(era5, os.path.join(expdir, name), num_iters=2, checkpoint_every=1,
                      fsdp=fsdp)
        FailingWrite.fail_rank, FailingWrite.fail = fail_rank, fail
        tr = FailingWrite(cfg, setup_runtime(cfg))
        out[name] = dict(error=None, ckpts=tr.ckpt_dir)
        try:
            tr.fit()
        except TrainingError as e:
            out[name] |= dict(error=str(e), seconds=time.monotonic() - tr.save_started)
        finally:
            tr.loaders.close()
    return out


@pytest.fixture(scope="module")
def write_failures(tmp_path_factory):
    era5 = write_era5(str(tmp_path_factory.mktemp("era5")), steps=40)
    return run_ranks(rank_write_failures, RANKS, era5, str(tmp_path_factory.mktemp("writes")),
                     timeout=90, pg_timeout=30)


@pytest.mark.parametrize("scenario", WRITE_FAILURES)
def test_a_write_failing_on_one_rank_ends_every_rank_with_one_line(write_failures, scenario):
    _, fail_rank, _, form = WRITE_FAILURES[scenario]
    results = [r[scenario] for r in write_failures]
    ckpts = results[0]["ckpts"]
    failed = os.path.join(ckpts, f"ckpt_00000002.{form}")
    lines = [r["error"] for r in results]
    assert len(set(lines)) == 1 and lines[0] is not None, lines
    assert lines[0].startswith(f"rank {fail_rank}: cannot write the checkpoint {failed} "
                               f"(No space left on device)"), lines[0]
    assert "\n" not in lines[0] and "Traceback" not in lines[0]
    assert all(r["seconds"] < 10 for r in results), [r["seconds"] for r in results]
    previous = os.path.join(ckpts, f"ckpt_00000001.{form}")
    assert os.listdir(ckpts) == [os.path.basename(previous)]  # nothing half-written is left
    state, path = checkpoint.load_latest(ckpts)
    assert path == previous and state["iteration"] == 1
    if form == "dcp":
        assert checkpoint.read_tensors(path)["model"]


# ----------------------------------------------------------------------------- init_from


def rank_init_from(era5, expdir, path, broken_rank):
    """Every rank: a new run from the weights at ``path``, which ``broken_rank`` cannot read (a
    file system error there); the error this rank raised, or "started"."""
    cfg = vit_cfg(era5, expdir, init_from=path, num_iters=1)
    rt = setup_runtime(cfg)
    broken = OSError(errno.EIO, os.strerror(errno.EIO))
    with mock.patch.object(start_weights.torch, "load", side_effect=broken) \
            if dist.get_rank() == broken_rank else contextlib.nullcontext():
        try:
            tr = Trainer(cfg, rt)
        except ConfigError as e:
            return str(e)
    tr.loaders.close()
    return "started"


def test_weights_one_rank_cannot_read_end_every_rank_with_one_line(tmp_path):
    """--init_from is read by every rank, and the ranks agree on the outcome: one rank that
    cannot read the file stops all of them with the same line naming it, at once (the others
    would otherwise wait for it in their first collective)."""
    era5 = write_era5(str(tmp_path / "era5"), steps=40)
    cfg = vit_cfg(era5, str(tmp_path / "first"), num_iters=1)
    tr = Trainer(cfg, setup_runtime(cfg))
    tr.fit()
    tr.loaders.close()
    path = checkpoint.list_checkpoints(tr.ckpt_dir)[0]
    results = run_ranks(rank_init_from, RANKS, era5, str(tmp_path / "tuned"), path, 2,
                        timeout=90, pg_timeout=30)
    assert results == [f"rank 2: init_from={path} does not load (it is not a complete "
                       f"checkpoint (damaged, cut short, or not written by torch.save): "
                       f"OSError: [Errno 5] Input/output error): give another checkpoint of "
                       f"that run, or the tutorial model's state_dict() saved with "
                       f"torch.save"] * RANKS, results
    assert run_ranks(rank_init_from, RANKS, era5, str(tmp_path / "tuned2"), path, -1,
                     timeout=90, pg_timeout=30) == ["started"] * RANKS


def test_checkpoint_exception_is_the_one_line(tmp_path):
    """DCP reports a failed shard write as a CheckpointException (a BaseException, its text a
    traceback per rank): it is the one line, and the previous checkpoint is kept."""
    ckpts = str(tmp_path / "checkpoints")
    write_dcp(ckpts, 2)
    with mock.patch.object(FileSystemWriter, "write_data", side_effect=NO_SPACE), \
            pytest.raises(TrainingError) as e:
        write_dcp(ckpts, 4)
    final = os.path.join(ckpts, "ckpt_00000004.dcp")
    assert str(e.value).startswith(f"cannot write the checkpoint {final} (No space left on "
                                   f"device)") and "\n" not in str(e.value)
    assert os.listdir(ckpts) == ["ckpt_00000002.dcp"]


# ----------------------------------------------------------------------------- leftovers


def test_leftovers_of_interrupted_writes_are_cleaned_and_a_set_aside_checkpoint_taken_back(
        tmp_path, caplog):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    checkpoint.save(str(ckpts), 2, stand_in(2), keep=9)
    (ckpts / "ckpt_00000004.pt.4242.tmp").write_bytes(b"cut short")  # kill -9 in write_file
    os.makedirs(ckpts / "ckpt_00000006.dcp.tmp" / "sub")  # kill -9 in save's dcp.save
    (ckpts / "ckpt_00000006.dcp.tmp" / "sub" / "__0_0.distcp").write_bytes(b"x")
    write_dcp(str(ckpts), 4)  # a crash after the step's rewrite was in place ...
    os.makedirs(ckpts / "ckpt_00000004.dcp.old")  # ... before its old copy was removed
    os.replace(write_dcp(str(ckpts), 8), ckpts / "ckpt_00000008.dcp.old")  # between the renames
    others = ["ckpt_00000002.pt.bak", "notes.tmp", "ckpt_00000010.pt.tmp", "ckpt_12.dcp.old",
              "ckpt_00000012.dcp.tmp"]  # (a file, not a directory)
    for name in others:
        (ckpts / name).write_bytes(b"not a leftover")
    cfg = vit_cfg(str(tmp_path / "no_data"), str(tmp_path), resume="true")
    with caplog.at_level(logging.INFO, logger="engine.checkpoint"):
        resume = Checkpointer(str(ckpts), cfg, Runtime(torch.device("cpu"))).resume()
        state, path = resume.state, resume.path
    assert path == str(ckpts / "ckpt_00000008.dcp") and state["iteration"] == 8
    assert sorted(os.listdir(ckpts)) == sorted(
        ["ckpt_00000002.pt", "ckpt_00000004.dcp", "ckpt_00000008.dcp"] + others)
    assert [r.getMessage() for r in caplog.records if r.name == "engine.checkpoint"] == [
        f"removed {ckpts / 'ckpt_00000004.dcp.old'}, left by an interrupted checkpoint write",
        f"removed {ckpts / 'ckpt_00000004.pt.4242.tmp'}, left by an interrupted checkpoint write",
        f"removed {ckpts / 'ckpt_00000006.dcp.tmp'}, left by an interrupted checkpoint write",
        f"restored the checkpoint {ckpts / 'ckpt_00000008.dcp'} from ckpt_00000008.dcp.old, set "
        f"aside by an interrupted checkpoint write"]


# ----------------------------------------------------------------------------- convert


def test_convert_refuses_to_overwrite_and_names_a_missing_source(tmp_path, capsys):
    src = write_dcp(str(tmp_path / "checkpoints"), 2)
    out = tmp_path / "taken.pt"
    out.write_bytes(b"someone's file")
    with pytest.raises(SystemExit) as e:
        convert_main([src, str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"error: {out} exists: choose another name for the "
                                         f"output, or remove it\n")
    assert out.read_bytes() == b"someone's file"
    missing, fresh = str(tmp_path / "missing.dcp"), tmp_path / "fresh.pt"
    with pytest.raises(SystemExit) as e:
        convert_main([missing, str(fresh)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {missing} does not exist: ")
    assert err.count("\n") == 1 and not fresh.exists()
    with pytest.raises(SystemExit) as e:
        convert_main([src])                      # OUT left out: one line, no usage block
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert err.startswith("error: the following arguments are required: out (")
