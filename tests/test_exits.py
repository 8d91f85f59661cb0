"""Exits meant to be immediate end within their bound even when something they wait for blocks:
the cleanup of ``RunEnding.fail`` on a broken process group (a TensorBoard close that never
returns, as on a stalled file system), and the exit hook's end of loader workers that SIGKILL does
not end (a worker in an uninterruptible read, simulated: its kill does nothing and it ignores
SIGTERM). Each runs as a script in a process of its own (forked from the preloaded server, see
tests/preloaded.py: it ends as a fresh interpreter ends) with the bounds lowered to 1 s."""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import preloaded
from conftest import ROOT
from engine.stop.signals import end_children

BOUND = 1.0
SLACK = 8.0  # process teardown on a loaded 2-core machine


def run_script(tmp_path, body: str, timeout: float = 60):
    """Run ``body`` as ``python script.py`` at the repository root; (returncode, stdout, stderr,
    seconds from its ``start`` line to its exit). Its output goes to files, not pipes: a worker
    it leaves behind keeps its copies of them open."""
    script = tmp_path / "script.py"
    script.write_text("import sys, time\nsys.path.insert(0, %r)\n" % ROOT + textwrap.dedent(body))
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        p = preloaded.Popen([sys.executable, str(script)], cwd=ROOT, stdout=out, stderr=err)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    ended = time.monotonic()
    out, err = out_path.read_text(), err_path.read_text()
    for pid in [int(line.split()[1]) for line in out.splitlines() if line.startswith("worker ")]:
        try:  # a worker left behind (reparented when the process exited)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode != -signal.SIGKILL, f"the process did not exit within {timeout} s:\n{out}\n{err}"
    starts = [float(line.split()[1]) for line in out.splitlines() if line.startswith("start ")]
    return p.returncode, out, err, ended - starts[-1] if starts else None


def test_hard_exit_timer_ends_a_blocked_process_with_its_code(tmp_path):
    code, _, _, took = run_script(tmp_path, f"""
        from engine.stop.signals import arm_hard_exit
        print("start", time.monotonic(), flush=True)
        arm_hard_exit(7, {BOUND})
        time.sleep(600)  # a write that never returns
    """)
    assert code == 7
    assert took < BOUND + SLACK


def test_fail_on_a_broken_group_exits_even_if_its_cleanup_blocks(tmp_path):
    code, out, err, took = run_script(tmp_path, f"""
        import types
        import engine.stop.signals
        engine.stop.signals.HARD_EXIT_AFTER_S = {BOUND}
        from engine.stop import NeverStop, RunEnding

        class StalledTrainer:
            def close(self, at_once=False):  # TensorBoard's flush on a file system that stalled
                time.sleep(600)

        end = RunEnding(types.SimpleNamespace(stop_signals=[]), NeverStop())
        end.trainer = StalledTrainer()
        print("start", time.monotonic(), flush=True)
        end.fail("a peer rank died", 5, broken_group=True)
    """)
    assert code == 5, err
    assert "error: a peer rank died" in err
    assert took < BOUND + SLACK


def test_exit_hook_does_not_wait_for_workers_sigkill_cannot_end(tmp_path):
    """The worker stays alive (its kill is a no-op, SIGTERM ignored): the process still exits
    with its own exit code after the bounded wait, instead of multiprocessing's hook joining the
    worker for ever."""
    code, out, err, took = run_script(tmp_path, f"""
        import atexit, multiprocessing, signal
        import engine.stop.signals
        engine.stop.signals.CHILD_JOIN_S = {BOUND}

        def worker():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as loader workers do
            time.sleep(600)

        if __name__ == "__main__":
            p = multiprocessing.get_context("fork").Process(target=worker, daemon=True)
            p.start()
            time.sleep(0.5)  # its SIGTERM handler is in place
            p.kill = lambda: None  # stuck in an uninterruptible read: SIGKILL does not end it yet
            atexit.register(engine.stop.signals._at_exit)  # as StopRequest.install does
            print("worker", p.pid, flush=True)
            print("start", time.monotonic(), flush=True)
            sys.exit(3)
    """)
    assert code == 3, err
    assert took < BOUND + SLACK


def _sleep():
    time.sleep(600)


def test_end_children_kills_and_reaps_workers_that_can_die():
    p = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
    p.start()
    t0 = time.monotonic()
    assert end_children([p], timeout=30) == []
    assert time.monotonic() - t0 < 10
    assert not p.is_alive() and p.exitcode == -signal.SIGKILL
    assert p not in multiprocessing.active_children()


def test_the_trainer_is_freed_before_the_process_groups_are_destroyed(tmp_path, monkeypatch):
    """train.run frees the trainer (its DDP reducer and the work it queued hold the process
    groups) before it destroys them: left to the interpreter's exit, gloo's threads could free
    it during finalization, which aborts a rank that trained to the end (SIGABRT, "terminate
    called without an active exception"; seen about once in 40 two-rank runs)."""
    import weakref

    import train
    from conftest import write_era5
    from engine.runtime import Runtime
    from test_ddp import vit_cfg

    made, alive = [], []

    class Noted(train.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(Runtime, "shutdown",
                        lambda rt: alive.extend(ref() is not None for ref in made))
    data = write_era5(str(tmp_path / "era5"), steps=12)
    train.run(vit_cfg(data, str(tmp_path / "exp"), num_iters=2), trainer_cls=Noted)
    assert len(made) == 1 and alive == [False]
