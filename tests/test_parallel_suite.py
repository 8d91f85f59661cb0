"""``python -m pytest -n 2``: each test file runs whole on one worker, in the order collected,
so a file's module fixtures are made once and the Slurm file (minutes of waiting) starts first."""
import os
import re
import subprocess
import sys

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
