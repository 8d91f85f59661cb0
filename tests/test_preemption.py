"""Stop signals (a time limit's warning, a preemption): the run checkpoints at the next log
point, says how to resume, exits 3; resuming ends exactly as an uninterrupted run. Also a kill
between the last checkpoint and the last validation, and ``--resume auto``."""
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

import preloaded
from conftest import ROOT, write_era5
from distributed_harness import find_free_port
from test_training import TINY_VIT, run_dir, tb_scalars, train
from settings.signals import held, release_ignored
from settings.signals import STOPPED_EXIT_CODE

# 2 years x 39 pairs // 4 = 19 steps per epoch, 57 in all; loss points every 2 steps.
COMMON = TINY_VIT + ["--num_epochs", "3", "--dropout", "0.1", "--checkpoint_keep", "10"]
FINAL = "ckpt_00000057.pt"
STOP_LINE = re.compile(r"Stopped on (SIG\w+) after step (\d+): checkpoint (\S+); resume with: "
                       r"(.*) \(exit code 3\)")

# train.py's run() with a Trainer that signals its own process at a chosen step (and, if asked,
# again while writing the stop checkpoint), or dies like kill -9 before a chosen validation.
DRIVER = """
import atexit, faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGQUIT, all_threads=True)  # a test that times out asks for stacks
sys.path.insert(0, {root!r})
import train
from settings.cli import from_argv

if os.environ.get("RING_S"):  # a ring of all-reduces that holds gloo's threads this long
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    from distributed_harness import simulate_long_ring
    simulate_long_ring(float(os.environ["RING_S"]))

class Signalled(train.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("COUNT_AGREEMENTS"):  # the ranks' stop proposals (host collectives)
            atexit.register(lambda: print(
                f"stop agreements: {{self.stopper.proposals}}", flush=True))

    def train_step(self, *args, **kwargs):
        if str(self.iteration) in os.environ.get("SIGNAL_AT_STEP", "").split(",") and \\
                str(self.rt.rank) == os.environ.get("SIGNAL_RANK", "0"):
            os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNAL", "SIGUSR1")))
        return super().train_step(*args, **kwargs)

    def save_checkpoint(self, epoch_sum=None):
        if self.stopper.request.signum and os.environ.get("SIGNAL_DURING_SAVE"):
            os.kill(os.getpid(), signal.SIGTERM)  # handled in the middle of the write below
        super().save_checkpoint(epoch_sum)

    def validate(self):
        if str(self.iteration) == os.environ.get("DIE_BEFORE_VALIDATION_AT"):
            os._exit(9)  # as kill -9: nothing runs after it
        if str(self.iteration) == os.environ.get("SIGNAL_IN_VALIDATION_AT") and \
                str(self.rt.rank) == os.environ.get("SIGNAL_RANK", "0"):
            os.environ.pop("SIGNAL_IN_VALIDATION_AT")
            loader = self.loaders.valid

            class Held:  # the validation loader's first batch never comes: the wait is ended
                def __iter__(self):
                    os.kill(os.getpid(), signal.SIGUSR1)
                    while True:
                        time.sleep(0.1)

            self.loaders.valid = Held()
            try:
                return super().validate()
            finally:
                self.loaders.valid = loader
        return super().validate()

train.run(from_argv(sys.argv[1:]), trainer_cls=Signalled)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_era5(str(tmp_path_factory.mktemp("era5")),
                      years={"train": [2016, 2017], "valid": [2018]}, steps=40)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted run."""
    exp = str(tmp_path_factory.mktemp("ref"))
    train(COMMON + ["--data_root", data, "--expdir", exp])
    return run_dir(exp)


def driver(tmp_path):
    """The driver script in ``tmp_path``, written once and whole: a rank started a moment
    earlier may be reading it (a file truncated under it runs as an empty script, exit 0)."""
    path = tmp_path / "driver.py"
    if not path.exists():
        tmp = tmp_path / f"driver.py.{os.getpid()}.tmp"
        tmp.write_text(DRIVER.format(root=ROOT))
        os.replace(tmp, path)
    return str(path)


def run_driver(tmp_path, args, **env):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    return preloaded.run([sys.executable, driver(tmp_path), *args], cwd=ROOT, env=e,
                         capture_output=True, text=True, timeout=300)


def assert_same_as_reference(ref_dir, got_dir, tags=("Loss/train", "Loss/valid")):
    a = torch.load(os.path.join(ref_dir, "checkpoints", FINAL), weights_only=True)
    b = torch.load(os.path.join(got_dir, "checkpoints", FINAL), weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, v in a["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg_sq"], b["optimizer"]["state"][k]["exp_avg_sq"])
    ref_tb, got_tb = (tb_scalars(os.path.join(d, "tensorboard")) for d in (ref_dir, got_dir))
    for tag in tags:
        ref_points = [(e.step, e.value) for e in ref_tb.Scalars(tag)]
        assert [(e.step, e.value) for e in got_tb.Scalars(tag)] == ref_points, tag
    avg = re.compile(r"Avg (?:train|val) loss=([0-9.e+-]+)")
    ref_log = open(os.path.join(ref_dir, "out.log")).read()
    got_log = open(os.path.join(got_dir, "out.log")).read()
    assert avg.findall(got_log) == avg.findall(ref_log) and len(avg.findall(ref_log)) == 6


def resume_as_told(stdout):
    """Run the command of the stop line, as a user would paste it."""
    (match,) = [m for m in map(STOP_LINE.search, stdout.splitlines()) if m]
    command = shlex.split(match.group(4))
    assert command[0] == "python" and command[-2:] == ["--resume", "auto"]
    return train(command[2:])  # (train.py also where a test's driver script stopped)


@pytest.mark.parametrize("sig,workers", [(signal.SIGTERM, 2), (signal.SIGUSR1, 0),
                                         (signal.SIGINT, 2)])
def test_signal_stops_with_checkpoint_and_resume_matches(tmp_path, data, reference, sig,
                                                         workers):
    """SIGTERM, SIGUSR1 and SIGINT (a terminal's Ctrl-C, sent to the whole process group) stop
    the run cleanly by default."""
    exp = str(tmp_path / "stopped")
    ckpts = os.path.join(run_dir(exp), "checkpoints")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = COMMON + ["--data_root", data, "--expdir", exp, "--checkpoint_every", "6",
                     "--num_data_workers", str(workers)]
    # Its own process group, as a Slurm job step: the signal reaches the loader workers too.
    p = preloaded.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        start_new_session=True)
    deadline = time.time() + 120
    while not (os.path.isdir(ckpts) and os.listdir(ckpts)):
        assert p.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.01)
    os.killpg(p.pid, sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == STOPPED_EXIT_CODE, out[-3000:] + err[-3000:]
    lines = [m for m in map(STOP_LINE.search, out.splitlines()) if m]
    assert len(lines) == 1 and lines[0].group(1) == sig.name, out[-3000:]
    step, path = int(lines[0].group(2)), lines[0].group(3)
    assert 6 <= step < 57 and step % 2 == 0  # at a log point (every 2 steps), before the end
    assert os.path.isfile(path) and path.endswith(f"ckpt_{step:08d}.pt")
    assert torch.load(path, weights_only=True)["iteration"] == step
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    resume_as_told(out)
    assert_same_as_reference(reference, run_dir(exp))


def test_second_signal_while_saving_is_harmless(tmp_path, data, reference):
    exp = str(tmp_path / "twice")
    r = run_driver(tmp_path, COMMON + ["--data_root", data, "--expdir", exp],
                   SIGNAL_AT_STEP="9", SIGNAL_DURING_SAVE="1")
    assert r.returncode == STOPPED_EXIT_CODE, r.stdout[-3000:] + r.stderr[-3000:]
    # Signalled in step 9, after step 10's batch was fetched and its proposal launched: the
    # first log point after that is step 12.
    assert "Stopped on SIGUSR1 after step 12:" in r.stdout
    ckpts = os.path.join(run_dir(exp), "checkpoints")
    assert os.listdir(ckpts) == ["ckpt_00000012.pt"]  # no stray temporary file
    resume_as_told(r.stdout)
    assert_same_as_reference(reference, run_dir(exp))


def test_a_second_ctrl_c_ends_the_run_at_once_in_one_line(tmp_path, data):
    """The first SIGINT asks for a clean stop; a second, before it, ends the run at once: one
    error line naming the checkpoint kept, exit code 130, no traceback."""
    exp = str(tmp_path / "exp")
    args = TINY_VIT + ["--data_root", data, "--num_iters", "12", "--checkpoint_every", "2",
                       "--expdir", exp]
    r = run_driver(tmp_path, args, SIGNAL="SIGINT", SIGNAL_AT_STEP="3,4")
    assert r.returncode == 130, r.stdout[-3000:] + r.stderr[-3000:]
    kept = os.path.join(run_dir(exp), "checkpoints", "ckpt_00000004.pt")
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: interrupted by SIGINT (Ctrl-C), at once, after step 4. Nothing was written: "
        f"the newest checkpoint, {kept}, is kept (continue with --resume auto)"), r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert "Stopped on" not in r.stdout


def test_a_signal_too_late_to_stop_the_run_is_logged_at_its_end(tmp_path, data):
    """SIGTERM in the run's last step, after the last log point's batch was fetched: the run
    ends as it would have (exit 0, its final checkpoint) and its log says so."""
    last = "ckpt_00000012.pt"  # the final checkpoint of 12 steps
    exp = str(tmp_path / "exp")
    args = TINY_VIT + ["--data_root", data, "--num_iters", "12", "--expdir", exp]
    r = run_driver(tmp_path, args, SIGNAL="SIGTERM", SIGNAL_AT_STEP="11")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    final = os.path.join(run_dir(exp), "checkpoints", last)
    line = (f"SIGTERM came as the run was ending: it ended as planned, on its final checkpoint "
            f"{final} (exit code 0: nothing is left to resume)")
    assert line in r.stdout and "Stopped on" not in r.stdout, r.stdout[-3000:]
    assert line in open(os.path.join(run_dir(exp), "out.log")).read()
    # On two ranks, rank 1's signal alone: rank 0 logs it (the ranks agree on it at the end).
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", str(tmp_path / "ranks")],
                               SIGNAL="SIGTERM", SIGNAL_AT_STEP="11", SIGNAL_RANK="1")
    final = os.path.join(run_dir(str(tmp_path / "ranks"), ws=2), "checkpoints", last)
    assert codes == [0, 0] and f"SIGTERM came as the run was ending: it ended as planned, on " \
        f"its final checkpoint {final}" in outs[0][0], outs


def launch_ranks(tmp_path, args, ranks=2, **env):
    """Two (or ``ranks``) gloo ranks as srun starts them (plain processes, no torchrun agent)."""
    port, script = find_free_port(), driver(tmp_path)
    procs = [preloaded.Popen(
        [sys.executable, script, *args], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 PYTHONUNBUFFERED="1", **env)) for r in range(ranks)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [p.returncode for p in procs], outs


def stop_resume_ranks(tmp_path, args, stop_step, final_step, ranks=2, **env):
    """Two (or ``ranks``) ranks that a signal (as ``env`` asks) stops after ``stop_step``, whose
    checkpoint alone is written, then resumed with ``--resume auto``, beside an uninterrupted
    run: their final models are bitwise the same. Returns rank 0's output of the stopped run and
    of the resumed one, the two run directories (uninterrupted, resumed) and the resumed run's
    final checkpoint."""
    ref_exp, exp = str(tmp_path / "ref"), str(tmp_path / "stopped")
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", exp], ranks, **env)
    assert codes == [STOPPED_EXIT_CODE] * ranks, outs
    assert f"Stopped on SIGUSR1 after step {stop_step}:" in outs[0][0], outs[0][0][-3000:]
    assert os.listdir(os.path.join(run_dir(exp, ws=ranks), "checkpoints")) == \
        [f"ckpt_{stop_step:08d}.pt"]
    for more in (["--expdir", exp, "--resume", "auto"], ["--expdir", ref_exp]):
        codes, resumed = launch_ranks(tmp_path, args + more, ranks)
        assert codes == [0] * ranks, resumed
        if more[-1] == "auto":
            resumed_out = resumed[0][0]
    dirs = [run_dir(e, ws=ranks) for e in (ref_exp, exp)]
    a, b = (torch.load(os.path.join(d, "checkpoints", f"ckpt_{final_step:08d}.pt"),
                       weights_only=True) for d in dirs)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    return outs[0][0], resumed_out, dirs, b


def test_signal_on_one_rank_stops_both_at_the_same_step(tmp_path, data):
    """Rank 1 alone gets a signal in step 3: both stop after step 6, and the run resumed from
    there ends as an uninterrupted one."""
    args = TINY_VIT + ["--data_root", data, "--num_iters", "12", "--dropout", "0.1",
                       "--num_data_workers", "0"]
    out, _, dirs, final = stop_resume_ranks(tmp_path, args, 6, 12, SIGNAL_AT_STEP="3",
                                            SIGNAL_RANK="1")
    assert final["rng"] != [] and len(final["rng"]) == 2
    ref_tb, got_tb = (tb_scalars(os.path.join(d, "tensorboard")) for d in dirs)
    assert [e.value for e in got_tb.Scalars("Loss/train")] == \
        [e.value for e in ref_tb.Scalars("Loss/train")]


def test_three_ranks_resume_bitwise_with_ddp(tmp_path, data):
    """DDP over three ranks, with gradient accumulation and dropout: stopped after step 6 and
    resumed, the run ends bitwise as an uninterrupted one. The resumed run first makes DDP
    group the gradients as the uninterrupted run's later steps do (``ParallelModel.regroup_gradients``);
    without it the ring of three adds some gradients in another order (about 1e-8 apart here)."""
    args = TINY_VIT + ["--data_root", data, "--num_iters", "12", "--dropout", "0.1",
                       "--num_data_workers", "0", "--grad_accum_steps", "2",
                       "--global_batch_size", "6", "--base_batch_size", "6"]
    _, resumed, dirs, _ = stop_resume_ranks(tmp_path, args, 6, 12, ranks=3, SIGNAL_AT_STEP="3")
    assert "at step 6 (epoch 1" in resumed, resumed[-2000:]
    ref_tb, got_tb = (tb_scalars(os.path.join(d, "tensorboard")) for d in dirs)
    assert [e.value for e in got_tb.Scalars("Loss/train")] == \
        [e.value for e in ref_tb.Scalars("Loss/train")]


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_fetched_further_ahead_still_stop_both_ranks_after_one_step(tmp_path, data,
                                                                            workers):
    """A ring longer than a step (all-reduces that hold gloo's threads 0.3 s, as over hundreds
    of ranks): after the first validation both ranks fetch each batch 2 steps ahead of its step
    (a batch more held, 2 steps between a proposal and its decision). A signal on rank 1 in
    step 22, after the batches up to step 24 were fetched: both stop after the log point of
    step 26, the first whose batch was fetched after the signal (24 with batches fetched one
    step ahead), and the run resumed from there ends as an uninterrupted one; with loader
    workers too, whose batch slots are then held one batch longer."""
    args = TINY_VIT + ["--data_root", data, "--num_iters", "36", "--dropout", "0.1",
                       "--num_data_workers", str(workers)]
    out, _, _, _ = stop_resume_ranks(tmp_path, args, 26, 36, SIGNAL_AT_STEP="22",
                                     SIGNAL_RANK="1", RING_S="0.3")
    assert "each batch is now fetched 2 steps ahead of its step" in out, out


@pytest.mark.parametrize("loader,agreements", [("lowmem", 7), ("synthetic", 4)])
def test_ranks_agree_after_each_fetch_unless_the_loader_never_waits(tmp_path, data, loader,
                                                                     agreements):
    """A signal on rank 1 in step 3, after step 4's batch was fetched: both ranks stop after the
    log point of step 6. With a loader that reads (lowmem) they propose after each of the 7
    fetches (steps 0-6); with one that never waits (the cached batch of synthetic) only after
    the fetches of log points (steps 0, 2, 4, 6)."""
    args = TINY_VIT + ["--data_root", data, "--num_iters", "12", "--num_data_workers", "0",
                       "--data_loader_config", loader, "--expdir", str(tmp_path / "exp")]
    codes, outs = launch_ranks(tmp_path, args, SIGNAL_AT_STEP="3", SIGNAL_RANK="1",
                                   COUNT_AGREEMENTS="1")
    assert codes == [STOPPED_EXIT_CODE] * 2, outs
    assert "Stopped on SIGUSR1 after step 6:" in outs[0][0]
    for out, _ in outs:
        assert f"stop agreements: {agreements}\n" in out, out[-2000:]


def test_resume_auto_starts_fresh_then_continues_and_never_reruns_a_finished_run(tmp_path,
                                                                                 data):
    args = TINY_VIT + ["--data_root", data, "--expdir", str(tmp_path), "--num_iters", "4",
                       "--resume", "auto"]
    first = train(args)
    assert "Resumed from" not in first.stdout and "Avg val loss" in first.stdout
    again = train(args)
    assert "Nothing to do: run 0 has finished its 4 steps (checkpoint " in again.stdout
    assert "ckpt_00000004.pt" in again.stdout and "Resumed from" not in again.stdout
    assert "Avg val loss" not in again.stdout  # finished: nothing is run or logged again
    valid = tb_scalars(os.path.join(run_dir(str(tmp_path)), "tensorboard")).Scalars("Loss/valid")
    assert len(valid) == 1


def test_kill_before_the_last_validation_resumes_to_it(tmp_path, data, reference):
    """An epoch's last step is written once, after its validation: a kill before that
    validation resumes from the previous epoch's checkpoint and runs the epoch again (no empty
    epoch), ending as the uninterrupted run."""
    exp = str(tmp_path / "killed")
    args = COMMON + ["--data_root", data, "--expdir", exp, "--checkpoint_every", "19"]
    r = run_driver(tmp_path, args, DIE_BEFORE_VALIDATION_AT="57")
    assert r.returncode == 9 and "Avg val loss" in r.stdout
    ckpts = os.path.join(run_dir(exp), "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["ckpt_00000019.pt", "ckpt_00000038.pt"]
    assert len(re.findall("Avg val loss", open(os.path.join(run_dir(exp), "out.log")).read())) == 2
    resumed = train(args + ["--resume"])
    assert "Epoch 3: " in resumed.stdout and "for 19 steps" in resumed.stdout
    assert "Checkpoint written" in resumed.stdout and resumed.stdout.count("ckpt_00000057") == 1
    assert_same_as_reference(reference, run_dir(exp), tags=("Loss/valid",))
    final = torch.load(os.path.join(ckpts, FINAL), weights_only=True)
    assert (final["epoch"], final["step_in_epoch"]) == (3, 0)  # records the validation as done
    again = train(args + ["--resume"])
    assert "Avg val loss" not in again.stdout


def test_a_stop_during_validation_resumes_to_the_validation_alone(tmp_path, data, reference):
    """A signal that ends a wait for a validation batch: the stop's checkpoint holds the epoch's
    steps, and the resumed run validates without retraining, saying so (not an empty epoch)."""
    exp = str(tmp_path / "stopped")
    args = COMMON + ["--data_root", data, "--expdir", exp, "--num_data_workers", "0"]
    r = run_driver(tmp_path, args, SIGNAL_IN_VALIDATION_AT="38")
    assert r.returncode == STOPPED_EXIT_CODE, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Stopped on SIGUSR1 after step 38:" in r.stdout
    resumed = resume_as_told(r.stdout)
    assert "Epoch 2: its steps ran before the resume" in resumed.stdout
    assert "for 0 steps" not in resumed.stdout
    assert_same_as_reference(reference, run_dir(exp), tags=("Loss/valid",))


def _held_child(ready, sig):
    # The signal is sent before this process is ready for it. (A pipe, not an Event: a process
    # that the signal ends inside an Event's wait would leave its lock held, and the parent's
    # set() would wait for it for ever.)
    ready.poll(10)
    release_ignored([sig])
    time.sleep(0.2)  # (a signal not dropped would be delivered here)


def test_a_process_started_holding_a_stop_signal_drops_one_sent_before_it_is_ready():
    """engine.stop.signals.held / release_ignored, as the DALI loader's workers use them: a process
    started while the signal is held back outlives one sent before its first call ignores it;
    started without, the default action ends it. The starting thread's mask is restored."""
    import multiprocessing

    ctx, sig = multiprocessing.get_context("fork"), signal.SIGUSR2
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handler = signal.signal(sig, signal.SIG_DFL)  # (one another test's run left here)
    try:
        _drops_held_signal(ctx, sig, before)
    finally:
        signal.signal(sig, handler)


def _drops_held_signal(ctx, sig, before):
    for holding, exitcode in ((True, 0), (False, -sig)):
        ready, go = ctx.Pipe(duplex=False)
        with held([sig]) if holding else contextlib.nullcontext():
            p = ctx.Process(target=_held_child, args=(ready, sig), daemon=True)
            p.start()
        try:
            os.kill(p.pid, sig)
            time.sleep(0.1)
            go.send(True)
            p.join(10)
            assert p.exitcode == exitcode, (holding, p.exitcode)
        finally:
            if p.is_alive():  # (never left behind for the interpreter's exit to wait on)
                p.kill()
                p.join()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_resume_and_stop_signals_settings():
    from settings.parse import build_config, parse_overrides

    def cfg(*argv):
        return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                            parse_overrides(list(argv))[1])

    assert cfg().resume is False and cfg().stop_signals == ["SIGTERM", "SIGUSR1", "SIGINT"]
    assert cfg("--resume").resume is True and cfg("--resume", "auto").resume == "auto"
    assert cfg("--resume", "false").resume is False and cfg("--resume=yes").resume is True
    assert cfg("--stop_signals", "[USR2, SIGINT]").stop_signals == ["USR2", "SIGINT"]
    for argv, needle in ((["--resume", "later"], "resume='later' is not one of"),
                         (["--stop_signals", "[SIGKILL]"], "'SIGKILL' is not a signal"),
                         (["--stop_signals", "[SIGFOO]"], "'SIGFOO' is not a signal")):
        r = preloaded.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True,
                          text=True)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1


def test_resume_command_replaces_any_resume_argument():
    from engine.stop.signals import resume_command

    argv = ["train.py", "--config", "short", "--resume", "--run_num", "a b"]
    assert resume_command(argv, 1) == \
        "python train.py --config short --run_num 'a b' --resume auto"
    assert resume_command(["train.py", "--resume", "true", "--lr=1e-3"], 4) == \
        "the same launcher and 4 ranks running train.py --lr=1e-3 --resume auto"
    assert resume_command(["train.py", "--resume=auto"], 1) == "python train.py --resume auto"
