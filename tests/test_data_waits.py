"""A run never hangs waiting for data: a stop signal reaches a rank blocked on its loader (the
checkpoint of the last finished step, the resume line, exit 3, and the resumed run ends exactly
as an uninterrupted one), and a loader that sends nothing for ``loader_timeout_s`` ends the run
with one line (exit 1, nothing written). Real training processes, on a data set of this file
whose reads of one chosen sample block forever (registered as test_toy_task registers its
problem, without touching the engine)."""
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Literal

import pytest
import torch

import preloaded
from conftest import ROOT
from datapipe import data_sets
from distributed_harness import find_free_port
from settings.signals import STOPPED_EXIT_CODE
from tasks import register
from test_preemption import STOP_LINE
from test_toy_task import LinearSamples, ToyConfig, ToyData, ToyTask
from test_training import tb_scalars

TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS_PER_EPOCH, EPOCHS, BATCH = 6, 3, 8  # 48 samples; 18 steps in all
FINAL = f"ckpt_{STEPS_PER_EPOCH * EPOCHS:08d}.pt"


@dataclasses.dataclass
class StallConfig(ToyConfig):
    model: Literal["stall"] = dataclasses.field(default="stall", metadata={"help": "the toy "
                                                "problem, whose reads can block forever"})
    stall_split: str = dataclasses.field(default="", metadata={
        "help": "train or valid: the split whose read of stall_sample blocks", "resume": True})
    stall_epoch: int = dataclasses.field(default=-1, metadata={
        "help": "the epoch (training keys) whose read of stall_sample blocks", "resume": True})
    stall_sample: int = dataclasses.field(default=-1, metadata={
        "help": "the sample whose read blocks forever (-1: none)", "resume": True})
    stall_marker: str = dataclasses.field(default="", metadata={
        "help": "file created when a read blocks", "resume": True})


class StallingSamples(LinearSamples):
    """The toy samples; reading ``stall`` (a key) creates ``marker`` and never returns."""

    def __init__(self, cfg, split):
        super().__init__(cfg.width, cfg.n_train if split == "train" else cfg.n_valid, cfg.seed,
                         split)
        self.stall = None
        if cfg.stall_split == split and cfg.stall_sample >= 0:
            self.stall = (cfg.stall_epoch if split == "train" else 0, cfg.stall_sample)
        self.marker = cfg.stall_marker

    def read_batch(self, keys, x, y):
        if self.stall is not None and self.stall in [tuple(k) for k in keys]:
            open(self.marker, "w").close()
            while True:
                time.sleep(3600)
        super().read_batch(keys, x, y)


class StallData(ToyData):
    def datasets(self, rows=None):
        return StallingSamples(self.cfg, "train"), StallingSamples(self.cfg, "valid")


def register_stall():
    """The stalling problem in this process (a fresh training process: the driver)."""
    from settings.config import register_config

    register_config("stall", StallConfig)
    data_sets.register(StallConfig, StallData)
    register(StallConfig, ToyTask)


DRIVER = f"""
import sys
sys.path[:0] = [{ROOT!r}, {TESTS!r}]
import train
from settings.cli import from_argv
from test_data_waits import register_stall

register_stall()
train.run(from_argv(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("stall")
    (d / "stall.yaml").write_text(
        f"stall:\n  model: stall\n  lr: 0.05\n  num_epochs: {EPOCHS}\n"
        f"  global_batch_size: {BATCH}\n  log_every: 4\n  seed: 3\n")
    (d / "driver.py").write_text(DRIVER)
    return d


def args(workdir, exp, *more):
    return ["--yaml_config", str(workdir / "stall.yaml"), "--config", "stall", "--expdir",
            str(exp), "--data_root", str(workdir / "data"), *map(str, more)]


def env(**more):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **more)


def start(workdir, argv, **more):
    return preloaded.Popen([sys.executable, str(workdir / "driver.py"), *argv], cwd=ROOT,
                           env=env(**more), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)


def communicate(p, timeout):
    """``p.communicate``; a process still running after ``timeout`` is killed with its group
    (a hang fails the test instead of outliving it)."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"still running after {timeout} s: {out[-2000:]} {err[-2000:]}")


def communicate_all(procs, timeout):
    try:
        return [communicate(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def run(workdir, argv):
    r = preloaded.run([sys.executable, str(workdir / "driver.py"), *argv], cwd=ROOT, env=env(),
                      capture_output=True, text=True, timeout=240)
    return r


def run_dir(exp, ws=1):
    return os.path.join(str(exp), "stall", str(ws), "0")


def sample_of_step(step_in_epoch, epoch, rank=0, ranks=1):
    """The first training sample that rank ``rank`` reads at ``step_in_epoch`` of ``epoch``."""
    from datapipe.data_loader import ShardedSampler

    sampler = ShardedSampler(48, BATCH, BATCH // ranks, rank, seed=3)
    sampler.set_epoch(epoch)
    return int(sampler.order()[step_in_epoch * BATCH + rank * (BATCH // ranks)])


def wait_for(path, procs, seconds=120):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.time() > deadline:
            try:
                outs = communicate_all(procs, 1)  # (and ended)
            except AssertionError as e:
                outs = e
            raise AssertionError(f"{path} not made in {seconds} s, or a process ended: {outs}")
        time.sleep(0.05)
    time.sleep(0.5)  # the rank is in its wait for the blocked batch now


@pytest.fixture(scope="module")
def reference(workdir):
    """The uninterrupted run."""
    exp = workdir / "reference"
    r = run(workdir, args(workdir, exp))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir(exp)


def assert_same_as_reference(ref_dir, got_dir):
    a, b = (torch.load(os.path.join(d, "checkpoints", FINAL), weights_only=True)
            for d in (ref_dir, got_dir))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ref_tb, got_tb = (tb_scalars(os.path.join(d, "tensorboard")) for d in (ref_dir, got_dir))
    for tag in ("Loss/train", "Loss/valid"):
        assert [(e.step, e.value) for e in got_tb.Scalars(tag)] == \
            [(e.step, e.value) for e in ref_tb.Scalars(tag)], tag
    avg = re.compile(r"Avg (?:train|val) loss=([0-9.e+-]+)")
    ref_log, got_log = (open(os.path.join(d, "out.log")).read() for d in (ref_dir, got_dir))
    assert avg.findall(got_log) == avg.findall(ref_log) and len(avg.findall(ref_log)) == 6


def resume_as_told(workdir, stdout):
    (match,) = [m for m in map(STOP_LINE.search, stdout.splitlines()) if m]
    command = shlex.split(match.group(4))
    assert command[0] == "python" and command[-2:] == ["--resume", "auto"]
    r = run(workdir, command[2:] + ["--stall_sample", "-1"])  # the data answer again
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return int(match.group(2))


@pytest.mark.parametrize("sig,workers,split", [(signal.SIGTERM, 2, "train"),
                                               (signal.SIGUSR1, 0, "train"),
                                               (signal.SIGTERM, 0, "valid")])
def test_stop_signal_while_waiting_for_data(tmp_path, workdir, reference, sig, workers, split):
    """Blocked in epoch 2 at its step 3 (run step 9, between the log points 8 and 12), or in
    the first validation (after step 6): the signal stops the run there within seconds."""
    exp, marker = tmp_path / "exp", tmp_path / "blocked"
    stall = sample_of_step(3, 1) if split == "train" else 0
    p = start(workdir, args(workdir, exp, "--num_data_workers", workers, "--stall_split", split,
                            "--stall_epoch", 1, "--stall_sample", stall, "--stall_marker",
                            marker))
    wait_for(marker, [p])
    t0 = time.time()
    os.killpg(p.pid, sig)
    out, err = communicate(p, 60)
    took = time.time() - t0
    assert p.returncode == STOPPED_EXIT_CODE, out[-3000:] + err[-3000:]
    assert took < 10, took
    assert "Traceback" not in err, err[-3000:]
    lines = [m for m in map(STOP_LINE.search, out.splitlines()) if m]
    assert len(lines) == 1 and lines[0].group(1) == sig.name, out[-3000:]
    step = int(lines[0].group(2))
    assert step == (9 if split == "train" else 6), out[-3000:]
    assert os.listdir(os.path.join(run_dir(exp), "checkpoints")) == [f"ckpt_{step:08d}.pt"]
    assert resume_as_told(workdir, out) == step
    assert_same_as_reference(reference, run_dir(exp))


def test_stop_signal_while_the_throughput_report_waits(tmp_path, workdir):
    """The report's passes (after the final checkpoint, epochs past the run's) are data waits
    too: blocked in its second round, the run stops with the final checkpoint as it was."""
    exp, marker = tmp_path / "exp", tmp_path / "blocked"
    p = start(workdir, args(workdir, exp, "--throughput_report", "--stall_split", "train",
                            "--stall_epoch", EPOCHS + 2, "--stall_sample",
                            sample_of_step(0, EPOCHS + 2), "--stall_marker", marker))
    wait_for(marker, [p])
    final = os.path.join(run_dir(exp), "checkpoints", FINAL)
    written = os.stat(final).st_mtime_ns
    os.killpg(p.pid, signal.SIGUSR1)
    out, err = communicate(p, 60)
    assert p.returncode == STOPPED_EXIT_CODE, out[-3000:] + err[-3000:]
    assert f"Stopped on SIGUSR1 after step {STEPS_PER_EPOCH * EPOCHS}: checkpoint {final}" in out
    assert os.stat(final).st_mtime_ns == written and "Throughput (" not in out
    r = run(workdir, args(workdir, exp, "--resume", "auto"))
    assert r.returncode == 0 and "Nothing to do" in r.stdout, r.stdout[-3000:] + r.stderr


def test_stalled_loader_ends_the_run_with_one_line(tmp_path, workdir):
    """Blocked at step 9 with loader_timeout_s 2: exit 1 after about 2 s, one line naming the
    loader, the batch and the setting; the checkpoints as they were."""
    exp, marker = tmp_path / "exp", tmp_path / "blocked"
    ckpts = os.path.join(run_dir(exp), "checkpoints")
    p = start(workdir, args(workdir, exp, "--num_data_workers", 1, "--stall_split", "train",
                            "--stall_epoch", 1, "--stall_sample", sample_of_step(3, 1),
                            "--stall_marker", marker, "--loader_timeout_s", 2,
                            "--checkpoint_every", 4))
    wait_for(os.path.join(ckpts, "ckpt_00000008.pt"), [p])  # written before step 9 blocks
    before = {f: os.stat(os.path.join(ckpts, f)).st_mtime_ns for f in os.listdir(ckpts)}
    out, err = communicate(p, 60)
    assert p.returncode == 1, out[-3000:] + err[-3000:]
    assert os.path.exists(marker)
    assert before == {f: os.stat(os.path.join(ckpts, f)).st_mtime_ns
                      for f in os.listdir(ckpts)}
    assert sorted(before) == ["ckpt_00000004.pt", "ckpt_00000008.pt"]
    (line,) = err.strip().splitlines()
    assert line.startswith("error: no batch came for 2 s (loader_timeout_s): the training "
                           "loader (BatchLoader"), line
    assert "ckpt_00000008.pt, is kept" in line and "--resume auto" in line, line
    if "waiting_for" not in dir(__import__("datapipe.batch_pool").batch_pool.BatchLoader):
        assert "1 worker process: epoch 2, batch 4" in line, line
    assert line[len("error: "):] in open(os.path.join(run_dir(exp), "out.log")).read()


def test_loader_timeout_setting(workdir):
    from settings.errors import ConfigError
    from settings.parse import build_config

    def cfg(**over):
        return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                            {k: str(v) for k, v in over.items()})

    assert cfg().loader_timeout_s == 600 and cfg(loader_timeout_s=0).loader_timeout_s == 0
    with pytest.raises(ConfigError, match="loader_timeout_s"):
        cfg(loader_timeout_s=-1)
    r = preloaded.run([sys.executable, "train.py", "--loader_timeout_s", "soon"], cwd=ROOT,
                      capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "loader_timeout_s" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- two ranks

def launch_two_ranks(workdir, argv):
    port = find_free_port()
    return [preloaded.Popen(
        [sys.executable, str(workdir / "driver.py"), *argv], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env=env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))) for r in range(2)]


def stalled_rank_1(workdir, exp, marker, *more):
    """Two gloo ranks; rank 1's read of run step 9 blocks (rank 0 reads on and waits for it)."""
    return launch_two_ranks(workdir, args(
        workdir, exp, "--num_data_workers", 0, "--stall_split", "train", "--stall_epoch", 1,
        "--stall_sample", sample_of_step(3, 1, rank=1, ranks=2), "--stall_marker", marker,
        *more))


def test_two_ranks_stop_at_the_same_step_while_one_waits_for_data(tmp_path, workdir):
    exp, ref, marker = tmp_path / "exp", tmp_path / "ref", tmp_path / "blocked"
    procs = stalled_rank_1(workdir, exp, marker)
    wait_for(marker, procs)
    t0 = time.time()
    for p in procs:  # as Slurm signals every task of the job step
        os.killpg(p.pid, signal.SIGTERM)
    outs = communicate_all(procs, 60)
    assert time.time() - t0 < 10
    assert [p.returncode for p in procs] == [STOPPED_EXIT_CODE] * 2, outs
    assert "Stopped on SIGTERM after step 9:" in outs[0][0], outs[0]
    stopped = run_dir(exp, ws=2)
    assert os.listdir(os.path.join(stopped, "checkpoints")) == ["ckpt_00000009.pt"]
    for directory, more in ((exp, ["--resume", "auto", "--stall_sample", -1]), (ref, [])):
        procs = launch_two_ranks(workdir, args(workdir, directory, *more))
        outs = communicate_all(procs, 240)
        assert [p.returncode for p in procs] == [0, 0], outs
    assert_same_as_reference(run_dir(ref, ws=2), stopped)


def test_two_ranks_end_when_one_loader_stalls(tmp_path, workdir):
    """The stalled rank says why (exit 1); its peer, waiting in step 8's gradient all-reduce
    (rank 1 fetches step 9's batch before step 8 runs), ends through the dead-peer path."""
    exp, marker = tmp_path / "exp", tmp_path / "blocked"
    procs = stalled_rank_1(workdir, exp, marker, "--loader_timeout_s", 2)
    outs = communicate_all(procs, 120)
    assert [p.returncode for p in procs] == [1, 1], outs
    assert outs[1][1].strip().splitlines()[-1].startswith(
        "[rank 1] error: no batch came for 2 s (loader_timeout_s): the training loader"), outs[1]
    assert "[rank 0] error: a collective failed after step 8" in outs[0][1], outs[0]
    assert not os.path.exists(os.path.join(run_dir(exp, ws=2), "checkpoints"))


def first_batch(stopper, loader, what: str = "training", epoch: int = 0):
    """The first batch of a pass of ``loader`` through ``stopper``; Interrupted where a stop
    signal ended the wait for it (the stopper then stops the pass before its first step)."""
    from engine.stop import Interrupted

    stops = []
    batch = next(stopper.batches(loader, what, epoch, 0, stop=stops.append), None)
    if stops:
        raise Interrupted(stops[0])
    return batch


def test_data_wait_ends_on_a_signal_and_on_its_timeout(monkeypatch):
    """In one process: a blocking read inside ``Stopper.fetch`` ends with Interrupted two
    seconds after a stop signal, or with LoaderStalled after the timeout; handlers and timer
    are put back after each wait."""
    from engine.stop import Interrupted, Stopper, StopRequest
    from engine.stop.signals import LoaderStalled

    request = StopRequest.install(["SIGUSR2"])
    try:
        stopper = Stopper(request, False, advice=lambda: "advice")
        alarm = signal.getsignal(signal.SIGALRM)

        class Blocked:
            def __iter__(self):
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(30)

        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            first_batch(stopper, Blocked())
        assert 1.5 < time.monotonic() - t0 < 5 and request.signum == signal.SIGUSR2
        assert signal.getsignal(signal.SIGALRM) is alarm
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        request.signum = 0
        stopper.timeout_s = 0.5

        class Slow:
            def __iter__(self):
                time.sleep(30)

        with pytest.raises(LoaderStalled, match=r"no batch came for 0.5 s .* the validation "
                                                r"loader \(Slow: epoch 3, batch 1\).* advice"):
            first_batch(stopper, Slow(), "validation", 2)
        assert list(stopper.batches([1, 2], "training", 0, 0)) == [1, 2]
    finally:
        request.restore()


def test_a_loader_that_never_waits_is_fetched_without_a_data_wait():
    """The device loader and the cached batch make each batch in this process: their fetches
    arm no timer and no handler (a stop signal waits for the next log point), and the ranks
    need not agree after each of them; every loader that reads does."""
    from datapipe.batch_pool import BatchLoader
    from datapipe.dali_loader import DALILoader
    from datapipe.data_loader import CachedBatchLoader
    from datapipe.device_loader import DeviceCropLoader
    from engine.stop import NeverStop, Stopper, may_wait

    assert [may_wait(cls.__new__(cls)) for cls in
            (BatchLoader, DALILoader, CachedBatchLoader, DeviceCropLoader)] == \
        [True, True, False, False]
    stopper = Stopper(NeverStop(), False, timeout_s=600)
    alarm = signal.getsignal(signal.SIGALRM)

    class Noting(list):
        def __iter__(self):
            for x in super().__iter__():
                yield x, signal.getsignal(signal.SIGALRM) is alarm

    class NeverWaits(Noting):
        never_waits = True

    assert [kept for _, kept in stopper.batches(NeverWaits([1, 2]), "training", 0, 0)] == \
        [True] * 2
    assert [kept for _, kept in stopper.batches(Noting([1, 2]), "training", 0, 0)] == [False] * 2


def test_close_ends_the_watchdog_thread_and_lets_go_of_the_advice():
    """The watchdog thread, started by the first fetch with a timeout, ends at ``close()`` (a
    run's end): while it runs it holds the stopper and what its advice refers to (a trainer)."""
    import gc
    import weakref

    from engine.stop import NeverStop, Stopper

    class Owner:  # as a trainer: its method is the advice
        def advice(self):
            return "advice"

    owner = Owner()
    stopper = Stopper(NeverStop(), False, timeout_s=600, advice=owner.advice)
    assert list(stopper.batches([1, 2], "training", 0, 0)) == [1, 2]
    thread = stopper._watchdog
    assert thread is not None and thread.is_alive()
    stopper.close()
    assert not thread.is_alive()
    gone = weakref.ref(owner)
    del owner, stopper
    gc.collect()
    assert gone() is None
    closed = Stopper(NeverStop(), False, timeout_s=600)
    closed.close()  # closed before any fetch: none is started later
    assert list(closed.batches([1], "training", 0, 0)) == [1] and closed._watchdog is None


def test_a_wait_no_handler_can_end_is_ended_by_the_watchdog():
    """A wait in C code that never returns to Python (here: the main thread blocks the timer's
    signal, as such code keeps it from running a handler) is ended by the watchdog thread with
    the same line, ``watchdog_grace_s`` after the timeout."""
    from engine.stop import NeverStop, Stopper
    from engine.stop.signals import LoaderStalled

    said = []
    stopper = Stopper(NeverStop(), False, timeout_s=0.5, advice=lambda: "advice",
                      fail=said.append, watchdog_grace_s=0.5)

    class Deaf:
        def __iter__(self):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            try:
                time.sleep(3)  # one call in C: the signal goes to another thread, no handler runs
                assert said
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # the timer's turn
            yield 1

    with pytest.raises(LoaderStalled):
        first_batch(stopper, Deaf())
    (line,) = said
    assert line.startswith("no batch came for 0.5 s (loader_timeout_s): the training loader "
                           "(Deaf: epoch 1, batch 1).") and line.endswith(" advice"), line


@pytest.mark.parametrize("ended_by", ["timeout", "signal"])
def test_the_watchdog_stays_armed_while_an_ended_wait_unwinds(ended_by):
    """A loader whose clean-up blocks once its wait was ended (a timeout or a stop signal
    raised in it; DALI drops its pipeline then): the watchdog ends the process
    ``watchdog_grace_s`` later, with a line that says the clean-up blocks."""
    from engine.stop import Interrupted, Stopper, StopRequest
    from engine.stop.signals import LoaderStalled

    said = []
    request = StopRequest.install(["SIGUSR1"])
    stopper = Stopper(request, False, timeout_s=0.3 if ended_by == "timeout" else 0,
                      advice=lambda: "advice", fail=said.append, watchdog_grace_s=0.3)

    class Stuck:
        def __iter__(self):
            try:
                if ended_by == "signal":
                    os.kill(os.getpid(), signal.SIGUSR1)  # ends the wait after its grace
                while True:
                    time.sleep(0.05)
            finally:  # the clean-up blocks until the watchdog has spoken
                deadline = time.monotonic() + 10
                while not said and time.monotonic() < deadline:
                    time.sleep(0.05)
            yield 1

    t0 = time.monotonic()
    try:
        with pytest.raises(LoaderStalled if ended_by == "timeout" else Interrupted):
            first_batch(stopper, Stuck())
    finally:
        request.restore()
    assert time.monotonic() - t0 < 10  # (the clean-up would block 10 s without the watchdog)
    (line,) = said
    assert line.startswith("the training loader (Stuck: epoch 1, batch 1) did not let go within "
                           "0.3 s of its wait's end") and line.endswith(" advice"), line


def test_data_waits_under_random_signals_delays_and_timeouts(monkeypatch):
    """A seeded stress test of the wait's invariants, over fetches whose batches come late or
    never, stop signals sent at random moments from another thread, and timeouts: a fetch ends
    with its batch, Interrupted (only after a signal, and no earlier than its grace) or
    LoaderStalled (only with a timeout, and no earlier than it); one that waits forever ends by
    the nearer of the two deadlines; after every fetch no timer is left armed and the handlers
    are those from before."""
    import random
    import threading

    from engine.stop import Interrupted, Stopper, StopRequest
    from engine.stop.signals import LoaderStalled

    grace, slack = 0.2, 0.4
    monkeypatch.setattr("engine.stop.SIGNAL_GRACE_S", grace)
    rng = random.Random(7)
    request = StopRequest.install(["SIGUSR2"])
    alarm = signal.getsignal(signal.SIGALRM)
    stopper = Stopper(request, False)

    class Late:
        def __init__(self, delay):
            self.delay = delay

        def __iter__(self):
            time.sleep(self.delay)  # (a batch that never comes: longer than any deadline)
            yield "batch"

    outcomes = set()
    try:
        for _ in range(40):
            request.signum = 0  # the engine stopped on an earlier one
            stopper.timeout_s = rng.choice([0, 0.3, 0.6])
            delay = rng.choice([0.0, 0.1, 0.5, 5.0])
            signal_at = rng.choice([None, 0.0, 0.05, 0.25])
            if delay == 5.0 and signal_at is None:
                stopper.timeout_s = stopper.timeout_s or 0.3  # (timeout 0 waits for it: 5 s)
            timer = None
            if signal_at is not None:
                timer = threading.Timer(signal_at, os.kill, (os.getpid(), signal.SIGUSR2))
            t0 = time.monotonic()
            if timer:
                timer.start()
            try:
                got = first_batch(stopper, Late(delay))
            except Interrupted:
                got = "interrupted"
            except LoaderStalled:
                got = "stalled"
            took = time.monotonic() - t0
            if timer:
                timer.join()
            outcomes.add(got)
            case = (stopper.timeout_s, delay, signal_at, got, round(took, 3))
            assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), case
            assert signal.getsignal(signal.SIGALRM) is alarm and request.while_waiting is None
            if got == "interrupted":
                assert signal_at is not None and took >= signal_at + grace - 0.05, case
            elif got == "stalled":
                assert stopper.timeout_s and took >= stopper.timeout_s - 0.05, case
            else:
                assert got == "batch", case
            if delay == 5.0:  # waited forever: ends by the nearer deadline
                deadlines = [stopper.timeout_s or 99,
                             99 if signal_at is None else signal_at + grace]
                assert got != "batch" and took < min(deadlines) + slack, case
        assert outcomes == {"batch", "interrupted", "stalled"}
    finally:
        request.restore()


TP_DRIVER = f"""
import os, sys, time
sys.path[:0] = [{ROOT!r}, {TESTS!r}]
import train
import datapipe.era5_data as era5
from settings.cli import from_argv

read = era5.ERA5Dataset.read_batch

def read_batch(self, keys, x, y):  # rank 1's first validation read blocks forever
    if os.environ["RANK"] == "1" and self.directory.rstrip("/").endswith("valid"):
        open(os.environ["STALL_MARKER"], "w").close()
        while True:
            time.sleep(3600)
    return read(self, keys, x, y)

era5.ERA5Dataset.read_batch = read_batch
train.run(from_argv(sys.argv[1:]))
"""


def test_tensor_parallel_ranks_leave_validation_together(tmp_path):
    """tensor_parallel 2: the two ranks of the model replica share every validation batch and
    its forward's collectives; rank 1's validation read blocks, rank 0 has its batch. On the
    signal both leave the validation at its first batch and stop after the epoch's last step."""
    from conftest import write_era5
    from test_training import TINY_VIT

    data = write_era5(str(tmp_path / "era5"))  # 2 x 11 pairs: 5 steps of 4 per epoch
    (tmp_path / "driver.py").write_text(TP_DRIVER)
    marker, port = tmp_path / "blocked", find_free_port()
    argv = TINY_VIT + ["--data_root", data, "--expdir", str(tmp_path / "exp"), "--num_epochs",
                       "2", "--tensor_parallel", "2"]
    procs = [preloaded.Popen(
        [sys.executable, str(tmp_path / "driver.py"), *argv], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env=env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), STALL_MARKER=str(marker))) for r in range(2)]
    wait_for(marker, procs)
    for p in procs:
        os.killpg(p.pid, signal.SIGTERM)
    outs = communicate_all(procs, 60)
    assert [p.returncode for p in procs] == [STOPPED_EXIT_CODE] * 2, outs
    assert "Stopped on SIGTERM after step 5:" in outs[0][0], outs[0]
    assert "Avg val loss" not in outs[0][0]
