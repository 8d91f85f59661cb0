"""Processes forked from the preloaded server (``tests/preloaded.py``) give what a fresh
``python script.py`` gives: the same output, byte for byte, and the same exit code, for a script
that ends normally, by ``sys.exit``, by an exception, by a signal or by a time limit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import preloaded

PROBE = r'''
import atexit, json, multiprocessing, os, sys, threading, time
atexit.register(lambda: print("atexit ran"))
import torch
mode = sys.argv[1]
print(json.dumps(dict(
    argv=sys.argv, cwd=os.getcwd(), path=sys.path, probe=os.environ.get("PROBE"),
    parent=str(multiprocessing.parent_process()), process=multiprocessing.current_process().name,
    start_method=multiprocessing.get_start_method(), threads=torch.get_num_threads(),
    name=__name__, main=sys.modules["__main__"].__file__, own_group=os.getpgid(0) == os.getpid(),
    buffering=[sys.stdout.line_buffering, sys.stdout.write_through])))
print("to stderr", file=sys.stderr)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
with open(os.environ["PROBE_FACTS"], "w") as f:  # what differs: who started it, what it has
    json.dump(dict(ppid=os.getppid(), train_loaded="train" in sys.modules), f)
if mode == "exit3":
    sys.exit(3)
if mode == "exit_message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("boom")
if mode == "wait":
    print("waiting", flush=True)
    time.sleep(60)
'''


@pytest.fixture
def probe(tmp_path, monkeypatch):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(PROBE)
    monkeypatch.setenv("PROBE_FACTS", str(tmp_path / "facts.json"))
    return str(path)


def facts(tmp_path):
    with open(tmp_path / "facts.json") as f:
        return json.load(f)


@pytest.mark.parametrize("mode", ["ok", "exit3", "exit_message", "raise"])
def test_a_forked_script_gives_what_a_fresh_one_gives(probe, tmp_path, mode):
    envs = [dict(os.environ, PROBE="buffered"),
            dict(os.environ, PROBE="unbuffered", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")]
    for env in envs:
        results = []
        for run in (subprocess.run, preloaded.run):
            r = run([sys.executable, probe, mode], cwd=tmp_path, env=env, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            results.append((r.returncode, r.stdout, facts(tmp_path)))
        (fresh_code, fresh_out, fresh), (forked_code, forked_out, forked) = results
        assert forked_code == fresh_code == {"ok": 0, "exit3": 3}.get(mode, 1)
        assert forked_out == fresh_out, (fresh_out, forked_out)
        assert forked_out.endswith("thread joined\natexit ran\n") and "to stderr" in forked_out
        # The fresh one is this process's child and loads the engine itself; the forked one is
        # the server's child, with the engine loaded before it started.
        assert fresh == {"ppid": os.getpid(), "train_loaded": False}
        assert forked["ppid"] != os.getpid() and forked["train_loaded"], forked
    info = json.loads(forked_out.splitlines()[0])
    assert info["parent"] == "None" and info["process"] == "MainProcess", info
    assert info["start_method"] == "fork" and info["threads"] == 1
    assert info["path"][0] == str(tmp_path / "scripts") and info["buffering"] == [False, True]


def test_a_module_run_gives_what_a_fresh_one_gives(tmp_path):
    cmd = [sys.executable, "-m", "json.tool", "--sort-keys"]
    (tmp_path / "x.json").write_text('{"b": 1, "a": [1, 2]}')
    with open(tmp_path / "x.json") as f:
        fresh = subprocess.run([*cmd, f.name], capture_output=True, text=True)
        forked = preloaded.run([*cmd, f.name], capture_output=True, text=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr) and '"a"' in fresh.stdout
    bad = [preloaded.run([*cmd, str(tmp_path / "missing.json")], capture_output=True, text=True),
           subprocess.run([*cmd, str(tmp_path / "missing.json")], capture_output=True, text=True)]
    assert bad[0].returncode == bad[1].returncode != 0 and bad[0].stderr == bad[1].stderr


@pytest.fixture
def caught_sigint():
    """SIGINT caught by Python's handler and not blocked in this process while the test starts
    its processes, as in an interactive shell's ``python``. A fresh interpreter inherits a SIGINT
    that its parent ignores (and keeps it ignored: no KeyboardInterrupt) or blocks: in a test
    worker that has run hundreds of other tests, something may have left either, and the fresh
    script then slept its 60 s through the signal (this test's failure in a full run, with
    nothing on its stderr but "to stderr")."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, signal.SIG_DFL if handler is None else handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_forked_script_as_it_ends_a_fresh_one(probe, tmp_path, sig, caught_sigint):
    ends = []
    for popen in (subprocess.Popen, preloaded.Popen):
        p = popen([sys.executable, probe, "wait"], stdout=subprocess.PIPE, text=True,
                  stderr=subprocess.PIPE, start_new_session=True)
        assert p.stdout.readline().startswith("{") and p.stdout.readline() == "waiting\n"
        assert p.poll() is None
        os.killpg(p.pid, sig)  # its own process group, as start_new_session makes it
        out, err = p.communicate(timeout=60)
        ends.append((p.returncode, out, err.splitlines()[-1] if err.strip() else ""))
    assert ends[0] == ends[1], ends
    assert ends[1][0] == -sig
    assert ends[1][2] == ("KeyboardInterrupt" if sig == signal.SIGINT else "to stderr")


def test_a_time_limit_kills_a_forked_script(probe):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, probe, "wait"], capture_output=True, timeout=3)
    assert time.monotonic() - start < 30


def test_an_import_time_variable_or_other_command_starts_a_fresh_process(probe, tmp_path):
    preloaded.run([sys.executable, probe, "ok"], capture_output=True)  # the server is running
    r = preloaded.run([sys.executable, probe, "ok"], capture_output=True, text=True,
                      env=dict(os.environ, TORCH_PROBE="read as torch loads"))
    assert r.returncode == 0 and facts(tmp_path) == {"ppid": os.getpid(), "train_loaded": False}
    r = preloaded.run([sys.executable, "-X", "utf8", probe, "ok"], capture_output=True)
    assert r.returncode == 0 and facts(tmp_path) == {"ppid": os.getpid(), "train_loaded": False}
    r = preloaded.run(["sh", "-c", "echo $0", "shell"], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (0, "shell\n")
