"""``python -m pytest -n 2``: each test file runs whole on one worker, in the order collected,
so a file's module fixtures are made once and the Slurm file (minutes of waiting) starts first."""
import os
import re
import subprocess
import sys

import pytest

from loader_harness import wait_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite_in(tmp_path, conftest: str, files: dict, *args, timeout: float = 120):
    """``python -m pytest -n 2 args`` over ``files`` (name: source) in ``tmp_path``, under the
    suite's own ``conftest`` (its text) and an empty slow_tests.txt."""
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "slow_tests.txt").write_text("")
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
                           *args, *files], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def _conftest() -> str:
    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:
        return f.read()


def test_two_workers_take_whole_files_in_collection_order(tmp_path):
    # three files of 2, 5 and 8 tests: xdist's own order would put the ones with most tests first
    files = {f"test_{name}.py": "import time\n" + "".join(
        f"\ndef test_{i}():\n    time.sleep(0.1)\n" for i in range(n))
        for name, n in (("first", 2), ("second", 5), ("third", 8))}
    r = _suite_in(tmp_path, _conftest(), files, "-v")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*?PASSED (\S+?)::", r.stdout, re.M)
    workers = {}
    for worker, path in ran:
        workers.setdefault(path, set()).add(worker)
    assert sorted(workers) == sorted(files), r.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers  # a file is never split
    # The first two files went out first, one to each worker.
    assert workers["test_first.py"] != workers["test_second.py"], workers


def test_the_slurm_file_is_collected_first():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", "tests/test_losses.py", "tests/test_slurm.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids and ids[0].startswith("tests/test_slurm.py::"), r.stdout[-2000:]
    assert ids[-1].startswith("tests/test_losses.py::")


CRASH = """
import ctypes, os, time

def test_crashes_with_a_forked_child_alive():
    pid = os.fork()
    if pid == 0:  # a loader's worker, say: it holds the worker's pipes to pytest
        time.sleep(300)
        os._exit(0)
    with open("child.pid", "w") as f:
        f.write(str(pid))
    ctypes.string_at(0)  # a segmentation fault
"""
HANG = """
import threading

def test_hangs():
    threading.Event().wait()
"""
PASS = """
import time

def test_passes():
    time.sleep(1)
"""


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_a_crash_or_a_hang_ends_the_run_with_its_name(tmp_path, kind):
    """Under -n 2, a worker that crashes while a process it forked lives, or a test that never
    returns, ends the run at once: reported as the test the worker crashed in (a hung test's
    stack printed), the test beside it finished, nothing forked left behind."""
    conftest = _conftest()
    assert "\nTEST_LIMIT_S = 600 " in conftest
    r = _suite_in(tmp_path, conftest.replace("\nTEST_LIMIT_S = 600 ", "\nTEST_LIMIT_S = 10 "),
                  {"test_a.py": CRASH if kind == "crash" else HANG, "test_b.py": PASS}, "-q")
    out = r.stdout + r.stderr
    name = "test_crashes_with_a_forked_child_alive" if kind == "crash" else "test_hangs"
    assert r.returncode == 1, out[-3000:]
    assert f"crashed while running 'test_a.py::{name}'" in out, out[-3000:]
    assert re.search(r"\b1 failed, 1 passed\b", out), out[-3000:]  # not run again
    if kind == "hang":
        assert "Timeout (0:00:10)!" in out and "in test_hangs" in out, out[-3000:]
    if kind == "crash":
        assert not wait_gone([int((tmp_path / "child.pid").read_text())], 5)
