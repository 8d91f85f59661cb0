"""The test harness's ranks (``tests/distributed_harness.py``): each sees the caller's
environment and working directory at the call, whether forked from the server that has torch
loaded or, where an import-time variable differs from the server's, spawned."""
import os
import sys

from distributed_harness import run_ranks


def probe():
    import torch.distributed as dist

    return (dist.get_rank(), os.environ.get("HARNESS_PROBE"), os.environ.get("TORCH_PROBE"),
            os.getcwd(), os.getppid(), "train" in sys.modules, os.environ["OMP_NUM_THREADS"])


def test_ranks_see_the_callers_environment_and_directory_forked_or_spawned(tmp_path,
                                                                           monkeypatch):
    run_ranks(probe, 1)  # the server is running from here on
    monkeypatch.setenv("HARNESS_PROBE", "after the server started")
    monkeypatch.chdir(tmp_path)
    forked = run_ranks(probe, 3)
    assert [r[:4] for r in forked] == [(r, "after the server started", None, str(tmp_path))
                                       for r in range(3)]
    # Forked from the server (not children of this process), with the engine already loaded.
    assert all(r[4] != os.getpid() and r[5] for r in forked), forked
    assert {r[6] for r in forked} == {"1"}

    monkeypatch.setenv("TORCH_PROBE", "read as torch loads")
    spawned = run_ranks(probe, 2)
    assert [r[:4] for r in spawned] == [(r, "after the server started", "read as torch loads",
                                         str(tmp_path)) for r in range(2)]
    assert all(r[4] == os.getpid() for r in spawned), spawned  # started afresh by this process
