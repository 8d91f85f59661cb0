"""benchmarks/gpu_runs.py without a GPU: its commands parse, it reads train.py's real log lines
(CPU ones from a run, GPU ones as train.py and utils/logging_utils.py write them), its table,
failed and timed-out runs as rows, and its refusals."""
import logging
import os
import time

import pytest

from benchmarks import gpu_runs
from conftest import ROOT
from test_training import TINY_VIT, train
from utils.config import build_config, from_argv
from utils.logging_utils import FORMAT

# A run that writes the pid of a child of its own to argv[1], then outlives any sane timeout;
# the child keeps the output pipe open, as torchrun's ranks and loader workers would.
SLEEPER = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("loading the data", flush=True)
time.sleep(120)
"""


def logged(*messages: str) -> str:
    """``messages`` as rank 0's log handlers print them (``<time> - INFO - <message>``)."""
    fmt = logging.Formatter(FORMAT)
    return "\n".join(fmt.format(logging.LogRecord("train", logging.INFO, "train.py", 0, m, None,
                                                  None)) for m in messages) + "\n"


def gpu_epoch(epoch: int, samples_per_s: float, tflops: float, peaks: list[float]) -> list[str]:
    """train.py's lines of one epoch on an H100 in bf16 (log_memory, then log_epoch)."""
    peak = 494.0
    return [f"Memory after forward pass (GB, per rank): {', '.join('9.500' for _ in peaks)}; "
            f"peak: {', '.join(f'{p:.3f}' for p in peaks)} [torch.cuda allocator statistics]",
            f"Epoch {epoch}: 12.34 s for 96 steps, {samples_per_s:.2f} samples/s (3.00 steps/s)",
            f"  Model {tflops:.3g} TFLOP/s per device ({139.9e9 / 1e9:.4g} GFLOP per sample)"
            f", MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s peak",
            "  Avg train loss=0.123456"]


def test_every_command_of_the_sequence_is_a_valid_config():
    for series in gpu_runs.SERIES.values():
        for _, cmd, args in series:
            script = cmd[-1]
            assert script in ("train.py", "train_graph.py", "train_mp.py")
            from_argv(args, f"{ROOT}/config/ViT.yaml", prog=script)


def test_no_row_claims_ddp_or_nccl_on_one_rank(capsys):
    for series in gpu_runs.SERIES.values():
        for label, cmd, _ in series:
            if "--nproc_per_node=1" in cmd:
                assert "no process group" in label and "DDP" not in label and "NCCL" not in label
    gpu_runs.main(["--dry-run"])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == sum(map(len, gpu_runs.SERIES.values()))
    assert not any("NCCL" in line or "DDP" in line for line in printed)


def test_reads_the_numbers_of_a_real_log_and_tabulates_them(tmp_path, era5_root):
    r = train(TINY_VIT + ["--data_root", era5_root, "--expdir", str(tmp_path), "--num_epochs",
                          "3"])
    got = gpu_runs.read_log(r.stdout + r.stderr)
    rates = [float(line.split(", ")[1].split()[0]) for line in r.stdout.splitlines()
             if "samples/s (" in line]
    assert len(rates) == 3 and got["samples_per_s"] == pytest.approx(sorted(rates[1:])[0] / 2
                                                                     + sorted(rates[1:])[1] / 2)
    assert got["tflops"] > 0 and got["mfu"] is None  # no peak table entry for a CPU
    assert got["peak_gb"] is not None and got["graph"] is None
    line = ("CUDA graph: step 2.00 ms replayed, 5.00 ms eager (2 warm-up steps): 2.50x")
    assert gpu_runs.read_log(r.stdout + line)["graph"] == line
    text = gpu_runs.table([("unet", "a", got), ("unet", "b", dict(got, samples_per_s=2 * got[
        "samples_per_s"], mfu=41.5))])
    rows = text.splitlines()
    assert rows[2].split(" | ")[3] == "1.00x" and rows[3].split(" | ")[3] == "2.00x"
    assert "41.5%" in rows[3] and "| - |" in rows[2]


def test_reads_gpu_lines_with_their_log_prefix_mfu_and_every_rank():
    text = logged(*gpu_epoch(1, 300.0, 40.1, [20.0, 20.5]), *gpu_epoch(2, 400.0, 47.3, [20.1, 21.25]),
                  *gpu_epoch(3, 500.0, 47.3, [20.0, 20.0]),
                  "CUDA graph: step 2.00 ms replayed, 5.00 ms eager (2 warm-up steps): 2.50x")
    assert " - INFO -   Model 47.3 TFLOP/s per device (139.9 GFLOP per sample), MFU 9.6% of 494 " \
           "TFLOP/s peak\n" in text  # the line of a real H100 run, prefix included
    got = gpu_runs.read_log(text)
    assert got["samples_per_s"] == 450.0  # median of epochs 2 and 3
    assert got["tflops"] == 47.3 and got["mfu"] == 9.6  # the last epoch's
    assert got["peak_gb"] == 21.25  # the second rank's, in epoch 2
    assert got["graph"].endswith("2.50x")
    big = gpu_runs.read_log(logged(*gpu_epoch(1, 9e3, 1234.5, [1.0])))  # printed as 1.23e+03
    assert big["tflops"] == 1230.0 and big["mfu"] == 249.9
    row = gpu_runs.table([("vit", "bf16", got)]).splitlines()[2]
    assert row == "| vit | bf16 | 450.0 | 1.00x | 47.3 | 9.6% | 21.25 |"
    rows = gpu_runs.table([("vit", "base", {"failed": "exit 1: a|b"}), ("vit", "bf16", got)])
    assert rows.splitlines()[2:] == ["| vit | base | failed: exit 1: a\\|b | - | - | - | - |",
                                     "| vit | bf16 | 450.0 | - | 47.3 | 9.6% | 21.25 |"]  # no base


def test_reads_the_mfu_that_train_py_logs_when_the_peak_is_known(tmp_path, era5_root, monkeypatch):
    """train.py's own epoch lines, with MFU (its GPU branch: the peak lookup given an H100's
    name), as its log file holds them."""
    import train
    from utils.flops import flops_per_sample, peak_tflops
    from utils.runtime import setup_runtime

    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_iters="2", amp_mode="bf16")
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    trainer = train.Trainer(cfg, setup_runtime(cfg))
    monkeypatch.setattr(train, "peak_tflops",
                        lambda device, amp, tf32: peak_tflops("NVIDIA H100 80GB HBM3", amp, tf32))
    val = trainer.validate()
    for epoch in range(2):
        trainer.state.epoch = epoch
        trainer.log_epoch(train.EpochStats(avg_loss=1.0, elapsed_s=1.0, steps=10,
                                           samples_per_s=8.0e5, data_wait=0.1), val, 0.1)
    log = open(os.path.join(trainer.run_dir, "out.log")).read()
    tflops = flops_per_sample(cfg) * 2.0e5 * 4 / 1e12  # 2e5 steps/s of 4 samples on 1 device
    got = gpu_runs.read_log(log)
    assert got["samples_per_s"] == 8e5
    assert got["tflops"] == pytest.approx(tflops, rel=5e-3) and got["tflops"] > 0
    assert got["mfu"] == pytest.approx(100 * tflops / 989.0, abs=0.05) and got["mfu"] > 0


def test_last_error_line_names_the_cause():
    traceback = ("Traceback (most recent call last):\n  File \"train.py\", line 1\n"
                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    torchrun = ("E0101 [0/0] failed (exitcode: 1) local_rank: 0 (pid: 7) of binary: python\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "====\ntrain.py FAILED\n  error_file: <N/A>\n====\n")
    assert gpu_runs.last_error_line(traceback + torchrun).startswith("torch.OutOfMemoryError: CUDA")
    assert gpu_runs.last_error_line("step 1\nerror: the loss is nan\n" + torchrun) == \
        "error: the loss is nan"
    assert gpu_runs.last_error_line("step 1\nstep 2\n\n") == "step 2"


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """main() past its GPU check on this CPU machine; the runs themselves still run for real."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the runs' --expdir goes there


def runs(tmp_path) -> dict:
    """label -> (command, arguments) of a run printing an H100's log, one that crashes with a
    traceback, a real train.py refusing a setting, and a run that hangs."""
    log, replay, sleeper = tmp_path / "gpu.log", tmp_path / "replay.py", tmp_path / "sleeper.py"
    crash = tmp_path / "crash.py"
    crash.write_text("print('step 1')\nraise RuntimeError('CUDA error: an illegal memory access')\n")
    log.write_text(logged(*gpu_epoch(1, 300.0, 40.1, [20.0]), *gpu_epoch(2, 400.0, 47.3, [21.5])))
    replay.write_text("import sys\nsys.stdout.write(open(sys.argv[1]).read())\n")
    sleeper.write_text(SLEEPER)
    return {"replayed": ([str(replay)], [str(log)]),
            "crashes": ([str(crash)], []),
            "bad setting": (["train.py"], TINY_VIT + ["--amp_mode", "bogus"]),
            "hangs": ([str(sleeper)], [str(tmp_path / "child.pid")])}


def test_failed_and_timed_out_runs_are_rows_saying_why(tmp_path, fake_gpu, monkeypatch, capsys):
    monkeypatch.setattr(gpu_runs, "SERIES", {"tiny": [(k, *runs(tmp_path)[k]) for k in
                                                      ("replayed", "crashes", "hangs")]})
    out = tmp_path / "GPU.md"
    out.write_text("kept")
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"^error: 2 of 3 runs failed"):
        gpu_runs.main(["--out", str(out), "--timeout", "3"])
    assert time.monotonic() - t0 < 60  # the sleeper's child did not hold the pipe for 120 s
    child = f"/proc/{(tmp_path / 'child.pid').read_text()}/stat"
    state = open(child).read().split()[2] if os.path.exists(child) else "gone"
    assert state in ("Z", "X", "gone")  # killed with its parent
    assert out.read_text() == "kept"
    rows = (tmp_path / "GPU_2.md").read_text().splitlines()[-3:]
    assert rows[0] == "| tiny | replayed | 400.0 | 1.00x | 47.3 | 9.6% | 21.50 |"
    assert rows[1] == ("| tiny | crashes | failed: exit 1: RuntimeError: CUDA error: an illegal "
                       "memory access | - | - | - | - |")
    assert rows[2] == ("| tiny | hangs | failed: timed out after 3 s; last line: loading the data "
                       "| - | - | - | - |")
    printed = capsys.readouterr().out
    assert "    failed: exit 1: RuntimeError" in printed and "written: " in printed


@pytest.mark.parametrize("broken, timeout, says", [
    ("bad setting", "60", "the first failure, [tiny] bad setting: exit 2: error: amp_mode='bogus'"),
    ("hangs", "1", "all 1 runs timed out after 1 s: raise --timeout")])
def test_nothing_succeeded_writes_nothing_and_says_what_to_fix(tmp_path, fake_gpu, monkeypatch,
                                                               broken, timeout, says):
    monkeypatch.setattr(gpu_runs, "SERIES", {"tiny": [(broken, *runs(tmp_path)[broken])]})
    out = tmp_path / "GPU.md"
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["--out", str(out), "--timeout", timeout])
    assert str(e.value.code).startswith("error: ") and says in str(e.value.code)
    assert str(e.value.code).endswith("nothing written")
    assert not out.exists() and not (tmp_path / "GPU_2.md").exists()


def test_refuses_without_a_gpu_and_changes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "GPU.md"
    out.write_text("kept")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="error: no CUDA GPU here"):
        gpu_runs.main(["--out", str(out)])
    assert out.read_text() == "kept"
    with pytest.raises(SystemExit):
        gpu_runs.main(["--out", str(out), "--timeout", "0"])
    assert "--timeout must be a positive number" in capsys.readouterr().err
