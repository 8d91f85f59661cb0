"""The start's line (observe/profiling.py): the process's start read from the kernel, the parts
adding up to the total, train.py's line after the first step, and torch.compile's caches reused
by a second run of the same config (compile_cache_dir)."""
import os
import re
import subprocess
import sys
import time

import pytest

from observe import profiling
from test_training import TINY_VIT, train

LINE = re.compile(r"Start: ([\d.]+) s to the end of the first step, by part:\n"
                  r"((?:.* INFO -   .*\n)+)")


def test_process_start_is_the_kernels_record_of_it():
    code = ("import time; t = time.time(); from observe import profiling; "
            "print(t - profiling.process_start_time())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = time.time()
    out = subprocess.run([sys.executable, "-c", f"import time; time.sleep(0.5); {code}"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    age = float(out)  # seconds the child had lived when it asked, its sleep included
    assert 0.5 <= age <= time.time() - before + 0.05, age
    assert profiling.process_start_time() <= time.time()


def test_parts_follow_each_other_and_add_up():
    now = [100.0]
    clock = profiling.StartClock(start=90.0, clock=lambda: now[0])
    for name, t in [("imports and set-up", 100.0), ("data", 102.5), ("first step", 110.0)]:
        now[0] = t
        clock.mark(name)
    assert clock.lines() == ["Start: 20.0 s to the end of the first step, by part:",
                             "  imports and set-up 10.0 s, data 2.5 s, first step 7.5 s"]
    assert clock.lines(width=30) == ["Start: 20.0 s to the end of the first step, by part:",
                                     "  imports and set-up 10.0 s", "  data 2.5 s, first step 7.5 s"]


def start_lines(log_text):
    return LINE.findall(log_text)


def test_train_py_says_how_long_the_start_took_once(tmp_path):
    exp = str(tmp_path / "logs")
    # two epochs of two steps (8 samples; 4 validated): the line once, after the first step
    r = train(TINY_VIT + ["--data_loader_config", "synthetic", "--num_epochs", "2",
                          "--limit_nsamples", "8", "--limit_nsamples_val", "4",
                          "--expdir", exp], fresh=True)  # its imports counted from the exec
    found = start_lines(r.stdout)
    assert len(found) == 1, r.stdout[-3000:]  # after the run's first step, not each epoch's
    total = float(found[0][0])
    parts = ", ".join(line.split(" INFO -   ", 1)[1] for line in found[0][1].splitlines())
    seconds = {name: float(v) for name, v in re.findall(r"([a-z -]+?) ([\d.]+) s(?:, |$)", parts)}
    assert list(seconds) == ["imports and set-up", "data", "loaders", "model",
                             "optimizer and logs", "first batch", "first step"]
    assert sum(seconds.values()) == pytest.approx(total, abs=0.1 * len(seconds))
    assert seconds["imports and set-up"] > 0.2  # torch's import at least: counted from the exec
    assert "compile caches" not in r.stdout  # not compiled


@pytest.mark.compile
def test_a_second_compiled_run_reuses_the_compile_caches(tmp_path):
    cache = str(tmp_path / "compile_cache")
    # one validation batch (4 samples), not a generated year's 1460: the compiled graphs are
    # the same (a training and an evaluation step), a fraction of the steps run through them
    common = TINY_VIT + ["--data_loader_config", "synthetic", "--num_iters", "2",
                         "--limit_nsamples", "8", "--limit_nsamples_val", "4",
                         "--enable_jit", "--compile_cache_dir", cache]
    caches = []
    for run in ("first", "second"):
        r = train(common + ["--expdir", str(tmp_path / run)])
        m = re.search(r"compile caches (.+): (\d+) hits, (\d+) misses", r.stdout)
        assert m, r.stdout[-3000:]
        caches.append((m.group(1), int(m.group(2)), int(m.group(3))))
        # the CPU's memory probe cannot see a compiled model's saved tensors: said, not dropped
        assert "Memory after forward pass: not measured" in r.stdout
        assert re.search(r"Process resident peak \(GiB, per rank\): \d", r.stdout)
    (dir1, hits1, misses1), (dir2, hits2, misses2) = caches
    assert dir1 == dir2 == cache and os.listdir(cache)
    assert hits1 == 0 and misses1 > 0  # a cold cache: everything compiled
    assert hits2 >= misses1 and misses2 == 0  # the second run found every graph


def test_a_compile_cache_dir_with_spaces_is_refused_before_anything_is_written(tmp_path):
    exp = str(tmp_path / "logs")
    r = train(TINY_VIT + ["--data_loader_config", "synthetic", "--num_iters", "2", "--enable_jit",
                          "--compile_cache_dir", str(tmp_path / "my cache"), "--expdir", exp],
              check=False)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "compile_cache_dir=" in errors[0] and "spaces" in errors[0]
    assert not os.path.exists(tmp_path / "my cache") and not os.path.exists(exp)
