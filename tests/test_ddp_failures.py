"""A rank that dies or hangs mid-run: its peers must fail with one clear line, not hang.

The ranks are plain processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as srun starts
them through export_DDP_vars.sh (no torchrun agent that would stop the peers itself), running
train.py's ``run`` with a Trainer whose rank 1 exits, or stops responding, at step 3.
"""
import os
import subprocess
import sys
import time

import pytest

import preloaded
from conftest import ROOT, write_era5
from distributed_harness import find_free_port

DRIVER = """
import os, sys, time
sys.path.insert(0, {root!r})
import train
from settings.cli import from_argv
from train import Trainer

class Failing(Trainer):
    def train_step(self, *args, **kwargs):
        if self.rt.rank == 1 and self.iteration == 3:
            if os.environ["FAIL_MODE"] == "exit":
                os._exit(9)
            open(os.environ["HANG_MARKER"], "w").close()
            time.sleep(600)
        return super().train_step(*args, **kwargs)

train.run(from_argv(sys.argv[1:]), trainer_cls=Failing)
"""

TINY = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
        "--num_heads", "2", "--global_batch_size", "4", "--synthesize_if_missing", "false",
        "--num_data_workers", "0", "--num_iters", "20", "--checkpoint_every", "0"]


def launch(tmp_path, mode, timeout_s):
    data = write_era5(str(tmp_path / "era5"), steps=20)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=ROOT))
    marker = tmp_path / "hanging"
    port = find_free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   FAIL_MODE=mode, HANG_MARKER=str(marker), PYTHONUNBUFFERED="1")
        procs.append(preloaded.Popen(
            [sys.executable, str(driver), *TINY, "--data_root", data,
             "--expdir", str(tmp_path / "logs"), "--dist_timeout_s", str(timeout_s)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs, marker


def finish(p, timeout):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"rank did not end within {timeout} s (a hang):\n{out[-2000:]}\n{err[-2000:]}")
    return p.returncode, out, err


def test_dead_rank_makes_peer_fail_fast_with_message(tmp_path):
    procs, _ = launch(tmp_path, "exit", timeout_s=300)
    rc1, _, _ = finish(procs[1], 180)
    died = time.monotonic()
    rc0, out, err = finish(procs[0], 120)
    assert rc1 == 9 and rc0 == 1
    assert time.monotonic() - died < 60, "the peer waited for the timeout instead of failing"
    last = err.strip().splitlines()[-1]
    assert last.startswith("[rank 0] error: a collective failed after step 3"), err[-3000:]
    assert "another rank most likely died" in last and "dist_timeout_s=300" in last
    assert "Traceback" not in err
    log = open(tmp_path / "logs" / "quickstart" / "2" / "0" / "out.log").read()
    assert "a collective failed after step 3" in log  # the reason stays in the run's log


def test_hung_rank_makes_peer_fail_after_dist_timeout(tmp_path):
    procs, marker = launch(tmp_path, "hang", timeout_s=5)
    try:
        rc0, out, err = finish(procs[0], 240)
        assert marker.exists(), err[-3000:]
        waited = time.time() - os.path.getmtime(marker)
        assert rc0 == 1
        last = err.strip().splitlines()[-1]
        assert last.startswith("[rank 0] error: a collective timed out after step 3"), err[-3000:]
        assert "dist_timeout_s=5" in last and "Traceback" not in err
        assert 4 <= waited < 60, waited
    finally:
        procs[1].kill()  # the hung rank: the one process this test started and left running
        procs[1].communicate()
