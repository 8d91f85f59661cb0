"""Many runs started at once into one experiment directory, as a job array or a sweep starts
them: each takes a run number of its own (its directory is created by exactly one process), a
run directory is trained by one process at a time (its ``.run.lock``, taken over when its
process has died), and synthetic data is made once, by one run, while the others wait for it.

The processes are released together: each imports torch and reads its config first, then waits
on a gate (a shared ``flock`` on a file the test holds exclusively) that the test opens for all
at once, so that they reach the run directory at the same moment.
"""
import fcntl
import glob
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import preloaded
from conftest import ROOT, write_era5
from datapipe import make_data
from engine import checkpoint, run_dir as run_dirs
from settings.parse import build_config
from datapipe.make_data import has_data
from settings.errors import ConfigError

TINY = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "16", "--depth", "1",
        "--num_heads", "2", "--global_batch_size", "4", "--base_batch_size", "4",
        "--num_iters", "2", "--synthesize_if_missing", "false"]
RUN_HEADER = re.compile(r" - INFO - Run (\S+) \(")

# train.py's run(), started when the test opens the gate (its flock on the file GATE), with a
# Trainer that, when HOLD is set, holds its run directory before its first step until the file
# HOLD appears.
DRIVER = """
import fcntl, os, sys, time
sys.path.insert(0, {root!r})
import train
from settings.cli import from_argv


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.005)


class Held(train.Trainer):
    def fit(self):
        if os.environ.get("HOLD"):
            open(os.environ["HOLD"] + "." + str(os.getpid()), "w").close()  # holding it now
            wait_for(os.environ["HOLD"])
        super().fit()


cfg = from_argv(sys.argv[1:])
gate = os.open(os.environ["GATE"], os.O_RDONLY)
open(os.path.join(os.environ["READY"], str(os.getpid())), "w").close()
fcntl.flock(gate, fcntl.LOCK_SH)  # waits until the test lets every process go at once
train.run(cfg, trainer_cls=Held)
"""


@pytest.fixture(scope="module")
def era5(tmp_path_factory):
    return write_era5(str(tmp_path_factory.mktemp("era5")))


_STARTED = []  # every driver process a test started


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:  # a test that failed while it waited (or held) at the gate
            p.kill()
            p.wait()


class Started:
    """Processes of the driver, each started with its own arguments, released together."""

    def __init__(self, tmp_path, argvs, **env):
        self.dir = tmp_path / "procs"
        self.dir.mkdir(exist_ok=True)
        driver = self.dir / "driver.py"
        driver.write_text(DRIVER.format(root=ROOT))
        ready = self.dir / "ready"
        ready.mkdir(exist_ok=True)
        for f in ready.iterdir():
            f.unlink()
        gate = self.dir / "gate"
        gate.touch()
        self.gate = os.open(gate, os.O_RDONLY)
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", READY=str(ready),
                 GATE=str(gate), **env)
        self.outs = [(self.dir / f"out{i}.txt", self.dir / f"err{i}.txt")
                     for i in range(len(argvs))]
        self.procs = []
        for argv, (out, err) in zip(argvs, self.outs):
            with open(out, "w") as o, open(err, "w") as r:
                self.procs.append(preloaded.Popen([sys.executable, str(driver), *argv],
                                                  cwd=ROOT, env=e, stdout=o, stderr=r))
            _STARTED.append(self.procs[-1])
        deadline = time.time() + 180
        while len(os.listdir(ready)) < len(self.procs):  # every one has imported torch
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} ended before the start: {self.output(i)}"
            assert time.time() < deadline, "the processes did not get ready"
            time.sleep(0.02)
        time.sleep(0.2)  # (from ready to waiting at the gate)
        os.close(self.gate)  # the gate opens: every waiter gets its shared lock at once

    def output(self, i) -> tuple[str, str]:
        out, err = self.outs[i]
        return out.read_text(), err.read_text()

    def wait(self, timeout=300) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]


def train(args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = preloaded.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                      text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def one_error_line(stderr) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ----------------------------------------------------------------------------- run numbers


def test_runs_started_together_each_train_a_run_of_their_own(tmp_path, era5):
    n = 8
    exp = tmp_path / "logs"
    started = Started(tmp_path, [TINY + ["--data_root", era5, "--expdir", str(exp)]] * n)
    codes = started.wait()
    assert codes == [0] * n, [started.output(i) for i, c in enumerate(codes) if c]
    parent = exp / "quickstart" / "1"
    assert sorted(os.listdir(parent), key=int) == [str(i) for i in range(n)]
    told = sorted(int(RUN_HEADER.search(started.output(i)[0]).group(1)) for i in range(n))
    assert told == list(range(n))  # each process says which run it took
    for run in os.listdir(parent):
        d = parent / run
        log = (d / "out.log").read_text()
        assert RUN_HEADER.findall(log) == [run], log  # one run in each log, its own
        assert log.count("Starting training loop") == 1 and log.count("Done: 2 steps") == 1
        state, path = checkpoint.load_latest(str(d / "checkpoints"))
        assert state is not None and state["iteration"] == 2, path
        assert len(glob.glob(str(d / "tensorboard" / "events.out.tfevents.*"))) == 1
        assert not (d / run_dirs.LOCK_NAME).exists()  # released at the end


def test_claims_race_for_numbers_not_for_directories(tmp_path):
    """In-process: 6 forked claimants of ``--run_num auto`` released at one barrier take 6
    distinct numbers; a number whose directory exists (another run's, or a name taken by hand)
    is skipped."""
    exp = tmp_path / "logs"
    os.makedirs(exp / "quickstart" / "1" / "1")  # made by someone else: never reused
    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                       {"expdir": str(exp)})
    barrier = multiprocessing.get_context("fork").Barrier(6)
    results = multiprocessing.get_context("fork").Queue()

    def claim():
        barrier.wait()
        results.put(run_dirs._claim_run(cfg, 1)[0])

    procs = [multiprocessing.get_context("fork").Process(target=claim) for _ in range(6)]
    for p in procs:
        p.start()
    got = sorted(int(results.get(timeout=60)) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == [2, 3, 4, 5, 6, 7]  # one above the highest, then up


def test_resume_picks_the_newest_run_of_its_own_model(tmp_path):
    """Under an --expdir the ViT's and the U-Net's quickstart runs share a parent: --resume takes
    the newest checkpoint of a run of the config's model, not the other model's newer one."""
    exp = tmp_path / "logs"
    parent = exp / "quickstart" / "1"
    for run, model, age in (("0", "vit", 200), ("1", "unet", 100), ("2", None, 300)):
        ckpt = parent / run / "checkpoints" / "ckpt_00000002.pt"
        os.makedirs(ckpt.parent)
        ckpt.write_bytes(b"")
        os.utime(ckpt, (time.time() - age, time.time() - age))
        if model:  # run 2 has no readable config: any model's
            (parent / run / "config.yaml").write_text(f"quickstart:\n  model: {model}\n")
    vit = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                       {"expdir": str(exp), "resume": "true"})
    assert run_dirs._claim_run(vit, 1)[0] == "0"  # not run 1, the U-Net's, though newer
    run_dirs.release_run_locks()
    unet = build_config(os.path.join(ROOT, "config", "UNet.yaml"), "quickstart",
                        {"expdir": str(exp), "resume": "true"})
    assert run_dirs._claim_run(unet, 1)[0] == "1"
    run_dirs.release_run_locks()


# ----------------------------------------------------------------------------- the run's lock


def test_two_resumes_of_one_run_one_trains_the_other_is_told_who_holds_it(tmp_path, era5):
    exp = str(tmp_path / "logs")
    common = TINY + ["--data_root", era5, "--expdir", exp, "--log_every", "1"]
    train(common)
    run0 = os.path.join(exp, "quickstart", "1", "0")
    hold = tmp_path / "hold"
    resume = common + ["--resume", "--num_iters", "6"]
    started = Started(tmp_path, [resume, resume], HOLD=str(hold))
    deadline = time.time() + 180
    while all(p.poll() is None for p in started.procs):  # the loser ends first
        assert time.time() < deadline, [started.output(i) for i in range(2)]
        time.sleep(0.02)
    loser = next(i for i, p in enumerate(started.procs) if p.poll() is not None)
    winner = started.procs[1 - loser]
    assert started.procs[loser].returncode == 2, started.output(loser)
    line = one_error_line(started.output(loser)[1])
    holder = f"process {winner.pid} on {socket.gethostname()}"
    assert line.startswith(f"error: run directory {run0} is in use: {holder} (since "), line
    while not os.path.exists(f"{hold}.{winner.pid}"):  # the winner holds it, before step 3
        assert winner.poll() is None, started.output(1 - loser)
        time.sleep(0.02)
    # A named run that a live process holds is refused the same way.
    r = train(common + ["--run_num", "0", "--resume", "--num_iters", "6"], check=False)
    assert r.returncode == 2 and f"is in use: {holder}" in one_error_line(r.stderr)
    # A stop signal ends the winner at its next log point (exit 3), and frees the run.
    winner.send_signal(signal.SIGTERM)
    hold.touch()
    assert winner.wait(timeout=120) == 3, started.output(1 - loser)
    assert "Stopped on SIGTERM after step 3" in started.output(1 - loser)[0]
    assert not os.path.exists(os.path.join(run0, run_dirs.LOCK_NAME))
    log = open(os.path.join(run0, "out.log")).read()
    assert len(RUN_HEADER.findall(log)) == 2 and " - ERROR - " not in log  # none from the refused


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, era5):
    exp = str(tmp_path / "logs")
    common = TINY + ["--data_root", era5, "--expdir", exp, "--run_num", "0"]
    hold = tmp_path / "hold"
    started = Started(tmp_path, [common], HOLD=str(hold))
    (killed,) = started.procs
    while not os.path.exists(f"{hold}.{killed.pid}"):
        assert killed.poll() is None, started.output(0)
        time.sleep(0.02)
    killed.kill()  # as kill -9 (or a lost node): its lock stays behind
    killed.wait()
    lock = os.path.join(exp, "quickstart", "1", "0", run_dirs.LOCK_NAME)
    assert json.load(open(lock))["pid"] == killed.pid
    r = train(common)
    assert f"Run 0 (--run_num 0: took over the lock of process {killed.pid} on " in r.stdout
    assert "which no longer runs)" in r.stdout and "Done: 2 steps" in r.stdout
    assert not os.path.exists(lock)
    # a run that ends on an error frees its run directory too
    r = train(common, check=False)
    assert r.returncode == 2 and "already holds checkpoints" in one_error_line(r.stderr)
    assert not os.path.exists(lock)


def _write_lock(run_dir, **record):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, run_dirs.LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": socket.gethostname(), "since": "2026-01-01T00:00:00",
                   "command": "python train.py", **record}, f)
    return path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_lock_holders_alive_dead_reused_or_elsewhere(tmp_path):
    """In-process: who holds a lock, as lock_run_dir judges it."""
    run = str(tmp_path / "run")
    # a live process of this host: refused, naming it
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        path = _write_lock(run, pid=sleeper.pid, start=run_dirs._start_time(sleeper.pid))
        with pytest.raises(run_dirs.RunInUse, match=f"in use: process {sleeper.pid} on "):
            run_dirs.lock_run_dir(run)
        # the same PID, but another process started under it (the PID was reused): stale
        _write_lock(run, pid=sleeper.pid, start="1")
        assert "took over the lock of process" in run_dirs.lock_run_dir(run)
        assert json.load(open(path))["pid"] == os.getpid()
        assert run_dirs.lock_run_dir(run) == ""  # this process holds it already: kept
        run_dirs.release_run_locks()
        assert not os.path.exists(path)
    finally:
        sleeper.kill()
    # exited but not yet reaped (a zombie): stale
    sleeper.wait()
    zombie = subprocess.Popen(["true"])
    deadline = time.time() + 10
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline
        time.sleep(0.01)
    _write_lock(run, pid=zombie.pid, start=run_dirs._start_time(zombie.pid))
    assert f"process {zombie.pid}" in run_dirs.lock_run_dir(run)
    run_dirs.release_run_locks()
    zombie.wait()
    # another host: not judged from here; the line says how to remove it
    path = _write_lock(run, pid=_dead_pid(), host="node0042")
    with pytest.raises(ConfigError) as e:
        run_dirs.lock_run_dir(run)
    assert "on node0042" in str(e.value) and f"remove {path} and start again" in str(e.value)
    assert "\n" not in str(e.value)
    # a lock file that names no process (its writer died between creating and writing it)
    with open(path, "w"):
        pass
    with pytest.raises(ConfigError, match=f"the lock file {path} names no process"):
        run_dirs.lock_run_dir(run)


def test_a_requeued_slurm_job_takes_over_the_lock_of_its_earlier_attempt(tmp_path,
                                                                          monkeypatch):
    """A Slurm job requeued after its node failed (or after a kill that left no time to remove
    the lock) may start on another node: the lock of the job's earlier attempt is taken over; a
    lock of another job, or of this very attempt, on another node is not."""
    run = str(tmp_path / "run")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    for job, restart in (("4712", 1), ("4711", 2)):
        _write_lock(run, pid=123, host="nid001", slurm_job=job, slurm_restart=restart)
        with pytest.raises(run_dirs.RunInUse, match=f"process 123 on nid001 .*Slurm job {job}"):
            run_dirs.lock_run_dir(run)
    path = _write_lock(run, pid=123, host="nid001", slurm_job="4711", slurm_restart=1)
    note = run_dirs.lock_run_dir(run)
    assert note.startswith("took over the lock of process 123 on nid001 ") and \
        note.endswith("an earlier attempt of this Slurm job")
    record = json.load(open(path))
    assert (record["pid"], record["slurm_job"], record["slurm_restart"]) == (os.getpid(), "4711", 2)
    run_dirs.release_run_locks()
    assert not os.path.exists(path)


def test_a_stale_lock_is_taken_over_by_exactly_one_process(tmp_path):
    """6 forked processes find the same dead holder's lock at once: one takes it over, the
    others are told it is in use by that one."""
    run = str(tmp_path / "run")
    path = _write_lock(run, pid=_dead_pid(), start=None)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(6), ctx.Queue()

    def take():
        barrier.wait()
        try:
            run_dirs.lock_run_dir(run)
            results.put(("took", os.getpid()))
            time.sleep(1)  # holds it while the others look
        except run_dirs.RunInUse as e:
            results.put(("refused", str(e)))

    procs = [ctx.Process(target=take) for _ in range(6)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    took = [pid for what, pid in got if what == "took"]
    assert len(took) == 1, got
    assert all(f"process {took[0]} on" in text for what, text in got if what == "refused"), got
    assert json.load(open(path))["pid"] == took[0]


# ----------------------------------------------------------------------------- data made once


def test_first_runs_started_together_make_the_data_once(tmp_path):
    n = 4
    exp, data = tmp_path / "logs", tmp_path / "era5"
    args = TINY + ["--expdir", str(exp), "--data_root", str(data), "--synthesize_if_missing",
                   "true", "--synthetic_steps_per_year", "8"]
    started = Started(tmp_path, [args] * n)
    codes = started.wait()
    outs = [started.output(i)[0] for i in range(n)]
    assert codes == [0] * n, [started.output(i) for i, c in enumerate(codes) if c]
    assert sum("generating synthetic vit data" in out for out in outs) == 1, outs
    assert sorted(os.listdir(exp / "quickstart" / "1"), key=int) == [str(i) for i in range(n)]
    assert sorted(os.listdir(tmp_path)) == ["era5", "logs", "procs"]  # no lock, no staging
    assert (data / "SYNTHETIC.txt").exists() and (data / "stats").is_dir()


def _tiny_cfg(tmp_path, **over):
    ov = {"img_size": "[16,32]", "synthesize_if_missing": "true",
          "synthetic_steps_per_year": "8", "data_root": str(tmp_path / "era5"),
          "expdir": str(tmp_path / "logs")}
    return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", {**ov, **over})


def _write_part_then(end):
    """A synthesize that writes part of a data set, then ends as ``end`` says."""
    def synthesize(cfg):
        os.makedirs(os.path.join(cfg.data_root, "train"))
        os.makedirs(os.path.join(cfg.data_root, "stats"))  # has_data would accept this much
        end()
    return synthesize


def test_a_maker_that_dies_leaves_no_data_set_and_the_next_makes_it(tmp_path, monkeypatch,
                                                                     caplog):
    cfg = _tiny_cfg(tmp_path)
    # failed with an exception part-way: nothing is left, neither data_root nor staging
    monkeypatch.setattr(make_data, "synthesize", _write_part_then(lambda: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        make_data.make_data_once(cfg)
    assert not has_data(cfg) and os.listdir(tmp_path) == []
    # killed (kill -9) part-way: only its staging directory is left, which is not data_root
    monkeypatch.setattr(make_data, "synthesize",
                        _write_part_then(lambda: os.kill(os.getpid(), signal.SIGKILL)))
    p = multiprocessing.get_context("fork").Process(target=make_data.make_data_once, args=(cfg,))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == -signal.SIGKILL
    (staging,) = [e for e in os.listdir(tmp_path) if e.startswith("era5.staging-")]
    assert not os.path.exists(cfg.data_root) and not has_data(cfg)
    # the next maker removes the dead one's staging directory and makes the set afresh
    monkeypatch.undo()
    with caplog.at_level("INFO"):
        assert make_data.make_data_once(cfg) is True
    assert f"Removed {tmp_path / staging}, left by a synthesis that did not finish" in caplog.text
    assert has_data(cfg) and sorted(os.listdir(tmp_path)) == ["era5"]
    assert make_data.make_data_once(cfg) is False  # there now: made once


def test_data_is_renamed_onto_an_empty_or_an_unfinished_synthetic_data_root(tmp_path):
    cfg = _tiny_cfg(tmp_path)
    os.makedirs(cfg.data_root)  # empty: replaced in one rename
    assert make_data.make_data_once(cfg) is True and has_data(cfg)
    import shutil
    shutil.rmtree(os.path.join(cfg.data_root, "stats"))  # a synthetic set missing a part
    assert make_data.make_data_once(cfg) is True and has_data(cfg)
    assert sorted(os.listdir(tmp_path)) == ["era5"]
