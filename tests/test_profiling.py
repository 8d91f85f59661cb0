"""--profile_trace: a torch.profiler trace of a few steps, with the named ranges, on CPU."""
import glob
import json
import logging
import os

import pytest
import torch

from distributed_harness import run_ranks
from test_training import TINY_VIT, _cfg, run_dir, train
from observe import profiling
from settings.errors import ConfigError
from observe.logging_utils import Nothing
from observe.profiling import NSYS_ENV, ProfilerWindow, TraceWindow, nvtx_range, unused_path

RANGES = ("forward", "backward", "optimizer", "data wait")


def event_names(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e.get("name") for e in events]


def test_vit_run_writes_a_trace_with_the_named_ranges(tmp_path, era5_root):
    trace_dir = tmp_path / "trace"
    exp = str(tmp_path / "logs")
    common = TINY_VIT + ["--data_root", era5_root, "--num_epochs", "2", "--log_every", "1",
                         "--profile_trace", str(trace_dir)]
    r = train(common + ["--expdir", exp, "--enable_manual_profiling"])
    log = open(os.path.join(run_dir(exp), "out.log")).read()
    # the profiler's own lines (USDT: ... profiler_start) stay out of the run's output
    assert "profiler_start" not in r.stdout + r.stderr and "USDT:" not in r.stderr, r.stderr
    assert "no CUDA profiler window" in log  # the nsys window needs a GPU: said, not silent
    steps_per_epoch = int(open(os.path.join(run_dir(exp), "config.yaml")).read()
                          .split("steps_per_epoch:")[1].split()[0])
    # The window opens at the second epoch's first step: 1 wait + 1 warm-up step, then 3 traced.
    first = steps_per_epoch + 2
    chrome = trace_dir / f"trace_rank0_step{first}.json"
    assert chrome.exists(), (sorted(os.listdir(trace_dir)), r.stdout[-2000:])
    assert f"Profiler trace written: {chrome}" in log
    names = event_names(chrome)
    for name in RANGES:
        assert name in names, name
    # Three active steps: three of each per-step range.
    assert names.count("optimizer") == 3 and names.count("forward") == 3
    assert sum(n.startswith("ProfilerStep#") for n in names if n) == 3
    tb = glob.glob(str(trace_dir / "tensorboard" / "rank0.*.pt.trace.json"))
    assert len(tb) == 1 and "forward" in event_names(tb[0])

    # A second run into the same directory keeps the first trace and writes a new file.
    before = chrome.read_bytes()
    train(common + ["--expdir", str(tmp_path / "logs2")])
    assert chrome.read_bytes() == before
    assert (trace_dir / f"trace_rank0_step{first}_2.json").exists()
    assert len(glob.glob(str(trace_dir / "tensorboard" / "*.pt.trace.json"))) == 2


def test_trace_dir_that_is_a_file_is_refused(tmp_path, era5_root):
    not_a_dir = tmp_path / "trace.json"
    not_a_dir.write_text("{}")
    r = train(TINY_VIT + ["--data_root", era5_root, "--expdir", str(tmp_path), "--num_iters", "2",
                          "--profile_trace", str(not_a_dir)], check=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: profile_trace=") and "give a directory" in lines[-1]
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    assert not_a_dir.read_text() == "{}"
    with pytest.raises(ConfigError, match="is a file, not a directory"):  # a directory below it
        _cfg(era5_root, tmp_path, profile_trace=str(not_a_dir / "below"))


def test_window_start_and_null_trace(tmp_path):
    d = str(tmp_path)
    assert isinstance(TraceWindow.for_run("", 0, 0, 10, 30), Nothing)
    assert TraceWindow.for_run(d, 0, 0, 10, 30).start == 10  # second epoch
    assert TraceWindow.for_run(d, 1, 0, 10, 14).start == 0  # too short after epoch 1: first
    assert TraceWindow.for_run(d, 0, 17, 10, 30).start == 17  # resumed past it: this launch


def test_window_traces_exactly_the_active_steps(tmp_path):
    w = TraceWindow(str(tmp_path), rank=3, start=2, end=100, wait=1, warmup=1, active=2)
    for it in range(12):
        w.step(it)
        w.step(it)  # repeated indices are ignored
        with nvtx_range("work"):
            torch.ones(4).sum()
    assert w.prof is None and w.written == [str(tmp_path / "trace_rank3_step4.json")]
    assert event_names(w.written[0]).count("work") == 2


def test_window_cut_short_by_the_end_of_the_run(tmp_path, caplog):
    w = TraceWindow(str(tmp_path), rank=0, start=0, end=3, wait=1, warmup=1, active=3)
    for it in range(4):
        w.step(it)
        with nvtx_range("work"):
            torch.ones(4).sum()
    assert w.prof is None
    assert w.written and event_names(w.written[0]).count("work") == 1
    # Ended in the warm-up step: nothing traced, and the log says so.
    w = TraceWindow(str(tmp_path / "short"), rank=0, start=0, end=1)
    w.step(0)
    w.step(1)
    assert w.prof is None and not w.written and "no torch.profiler trace" in caplog.text


CUDA = torch.device("cuda", 0)


@pytest.fixture
def cuda_profiler(monkeypatch, caplog):
    """The CUDA profiler API's calls, recorded instead of made."""
    caplog.set_level(logging.INFO, logger="train")
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.delenv(NSYS_ENV, raising=False)
    return calls


def drive(window, steps, calls):
    """The step index at each profiler call, stepping as train.py does."""
    at = []
    for it in range(steps):
        n = len(calls)
        window.step(it)
        at += [(calls[i], it) for i in range(n, len(calls))]
    return at


def test_cuda_profiler_window_brackets_30_steps_of_the_second_epoch(cuda_profiler, caplog):
    w = ProfilerWindow.for_run(True, CUDA, iteration=0, steps_per_epoch=10, total_steps=100)
    assert drive(w, 100, cuda_profiler) == [("start", 10), ("stop", 40)]
    assert "CUDA profiler window: steps 11-40" in caplog.text
    # resumed past the second epoch's start: from this launch's first step
    w = ProfilerWindow.for_run(True, CUDA, iteration=55, steps_per_epoch=10, total_steps=100)
    cuda_profiler.clear()
    assert drive(w, 100, cuda_profiler) == [("start", 55), ("stop", 85)]
    # cut at the run's end: the window is what is left of it
    w = ProfilerWindow.for_run(True, CUDA, iteration=0, steps_per_epoch=10, total_steps=25)
    assert (w.start, w.stop) == (10, 25)


def test_a_run_under_nsys_opens_the_window_without_the_flag(cuda_profiler, monkeypatch, caplog):
    assert isinstance(ProfilerWindow.for_run(False, CUDA, 0, 10, 100), Nothing)
    monkeypatch.setenv(NSYS_ENV, "1")
    w = ProfilerWindow.for_run(False, CUDA, 0, 10, 100)
    assert drive(w, 100, cuda_profiler) == [("start", 10), ("stop", 40)]
    assert f"opened because {NSYS_ENV} is set" in caplog.text


def test_cuda_profiler_window_that_cannot_open_says_why(cuda_profiler, monkeypatch, caplog):
    monkeypatch.setenv(NSYS_ENV, "1")
    w = ProfilerWindow.for_run(True, torch.device("cpu"), 0, 10, 100)
    assert drive(w, 100, cuda_profiler) == []
    assert "no CUDA profiler window" in caplog.text and "--profile_trace" in caplog.text
    caplog.clear()
    w = ProfilerWindow.for_run(True, CUDA, 0, 10, 10)  # one epoch: no second one to record
    assert drive(w, 10, cuda_profiler) == []
    assert "nothing is recorded" in caplog.text and "--num_epochs 2" in caplog.text


def test_ranges_without_the_nvtx_package(monkeypatch):
    monkeypatch.setattr(profiling, "_nvtx", None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiling.nvtx_range("forward"):
            torch.ones(2).sum()
    assert [e.name for e in prof.events()].count("forward") == 1


def test_each_fetch_of_a_pass_is_a_data_wait_range_and_items_are_kept():
    from engine.stop import NeverStop, Stopper
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        items = list(Stopper(NeverStop(), False).batches([1, 2, 3], "training", 0, 0))
    assert items == [1, 2, 3]
    # one range per item and one for the fetch that ends the iteration
    assert sum(e.name == "data wait" for e in prof.events()) == 4


def test_unused_path_never_overwrites(tmp_path):
    p = tmp_path / "t.json"
    assert unused_path(str(p)) == str(p)
    p.write_text("x")
    assert unused_path(str(p)) == str(tmp_path / "t_2.json")
    (tmp_path / "t_2.json").write_text("x")
    assert unused_path(str(p)) == str(tmp_path / "t_3.json")


def trace_a_short_run(era5_root, expdir, trace_dir):
    """Train 5 steps with --profile_trace (on every rank when under run_ranks)."""
    from train import Trainer
    from engine.runtime import setup_runtime

    cfg = _cfg(era5_root, expdir, num_iters="5", profile_trace=trace_dir)
    tr = Trainer(cfg, setup_runtime(cfg))
    tr.fit()
    return tr.run_log.trace.written


def is_collective(name):
    return name is not None and ("all_reduce" in name or "allreduce" in name)


def test_every_data_parallel_rank_writes_its_own_trace(tmp_path, era5_root):
    # Single process reference: the same 5-step run, traced from its first step.
    serial = trace_a_short_run(era5_root, tmp_path / "serial", str(tmp_path / "serial_trace"))
    ranks = run_ranks(trace_a_short_run, 2, era5_root, tmp_path / "ddp", str(tmp_path / "trace"),
                      timeout=240)
    assert serial == [str(tmp_path / "serial_trace" / "trace_rank0_step2.json")]
    assert ranks == [[str(tmp_path / "trace" / f"trace_rank{r}_step2.json")] for r in (0, 1)]
    reference = event_names(serial[0])
    assert not any(map(is_collective, reference))
    for (path,) in ranks:
        names = event_names(path)
        for name in RANGES:
            assert names.count(name) == reference.count(name) > 0, (path, name)
        assert any(map(is_collective, names)), path  # DDP's gradient all-reduce is in the trace
    assert len(glob.glob(str(tmp_path / "trace" / "tensorboard" / "rank1.*.pt.trace.json"))) == 1
