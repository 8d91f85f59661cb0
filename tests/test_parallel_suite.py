"""``python -m pytest -n 2``: each test file runs whole on one worker, in the order collected,
so a file's module fixtures are made once and the Slurm file (minutes of waiting) starts first."""
import os
import re
import subprocess
import sys

import pytest

from loader_harness import wait_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_workers_take_whole_files_in_collection_order():
    files = ["tests/test_losses.py", "tests/test_rotations.py", "tests/test_fidelity.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider",
                        *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*?PASSED (tests/\S+?)::", r.stdout, re.M)
    workers = {}
    for worker, path in ran:
        workers.setdefault(path, set()).add(worker)
    assert sorted(workers) == sorted(files), r.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers  # a file is never split
    # The first two files went out first, one to each worker (xdist's own order would put
    # test_rotations.py and test_fidelity.py, the files with the most tests, first).
    assert workers[files[0]] != workers[files[1]], workers


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
    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:
        conftest = f.read()
    assert "\nTEST_LIMIT_S = 600 " in conftest
    (tmp_path / "conftest.py").write_text(conftest.replace("\nTEST_LIMIT_S = 600 ",
                                                           "\nTEST_LIMIT_S = 10 "))
    (tmp_path / "slow_tests.txt").write_text("")
    (tmp_path / "test_a.py").write_text(CRASH if kind == "crash" else HANG)
    (tmp_path / "test_b.py").write_text(PASS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                        "test_a.py", "test_b.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    out = r.stdout + r.stderr
    name = "test_crashes_with_a_forked_child_alive" if kind == "crash" else "test_hangs"
    assert r.returncode == 1, out[-3000:]
    assert f"crashed while running 'test_a.py::{name}'" in out, out[-3000:]
    assert re.search(r"\b1 failed, 1 passed\b", out), out[-3000:]  # not run again
    if kind == "hang":
        assert "Timeout (0:00:10)!" in out and "in test_hangs" in out, out[-3000:]
    if kind == "crash":
        assert not wait_gone([int((tmp_path / "child.pid").read_text())], 5)
