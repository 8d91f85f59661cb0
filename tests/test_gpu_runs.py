"""benchmarks/gpu_runs.py and benchmarks/gpu_data.py without a GPU: the plan (dry run, every
command a valid config, the calls within their budget), the data maker (files the project's
loaders read), the parsers on train.py's real lines (CPU ones from a run, GPU ones as train.py,
engine/throughput_report.py and observe/logging_utils.py write them), the goals, the table,
failed, timed-out and skipped runs as rows, and the refusals."""
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

import preloaded
from benchmarks import gpu_data, gpu_runs
from benchmarks.gpu_runs import Run
from conftest import ROOT
from test_training import TINY_VIT, train
from settings.parse import build_config
from settings.cli import from_argv
from datapipe.data_loader import build_loaders
from datapipe.era5_data import load_stats
from observe.logging_utils import FORMAT
from engine.throughput_report import _modes_text, bottleneck_line

CPU = torch.device("cpu")

# A run that writes the pid of a child of its own to argv[1], then outlives any sane timeout;
# the child keeps the output pipe open, as loader workers would.
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


def gpu_epoch(epoch: int, samples_per_s: float, tflops: float, peaks: list[float],
              wait: float = 0.41) -> list[str]:
    """train.py's lines of one epoch on an H100 in bf16 (log_memory, then log_epoch's f-strings)."""
    peak = 494.0
    return [f"Memory after forward pass (GiB, per rank): {', '.join('9.500' for _ in peaks)}; "
            f"peak: {', '.join(f'{p:.3f}' for p in peaks)}",
            "  (measured as: torch.cuda allocator statistics)",
            f"Epoch {epoch}: 6.35 s for 24 steps, {samples_per_s:.2f} samples/s (3.78 steps/s)",
            f"  Waited for data {100 * wait:.0f}% of the epoch (device idle); steady state "
            f"(after step 1) {1.5 * samples_per_s:.2f} samples/s",
            f"  Model {tflops:.3g} TFLOP/s per device ({139.9e9 / 1e9:.4g} GFLOP per sample)"
            f", MFU {100 * tflops / peak:.1f}% of {peak:g} TFLOP/s peak",
            "  Avg train loss=0.123456"]


def report_lines(io: float, synthetic: float, full: float) -> list[str]:
    """engine/throughput_report.py's summary lines for these means (its own formatting)."""
    stats = {"IO": {"mean": io, "std": 1.0}, "SYNTHETIC": {"mean": synthetic, "std": 2.0},
             "FULL": {"mean": full, "std": 0.5}}
    return [f"Throughput (samples/s, mean +/- std of 3 rounds of 20 batches): "
            f"{_modes_text(stats)}", bottleneck_line(io, synthetic, full)]


def all_runs():
    return [run for series in gpu_runs.SERIES.values() for run in series]


def plan(monkeypatch, series: dict):
    """``series`` as the whole plan, run by a call without --only."""
    monkeypatch.setattr(gpu_runs, "SERIES", series)
    monkeypatch.setattr(gpu_runs, "RUNS", {r.key: r for runs in series.values() for r in runs})
    monkeypatch.setattr(gpu_runs, "PLAN", tuple(series))


def default_runs():
    return gpu_runs.select(gpu_runs.PLAN)


# ------------------------------------------------------------------------------ the plan

def test_dry_run_lists_every_command_with_its_estimate_and_runs_nothing(tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    data = tmp_path / "data"
    gpu_runs.main(["--dry-run", "--data", str(data)])
    printed = capsys.readouterr().out.splitlines()
    rows = [line for line in printed if line.startswith("[")]
    assert len(rows) == len(default_runs())
    assert all(re.search(r": est \d+ s, timeout \d+ s$", line) for line in rows)
    commands = [line.strip() for line in printed if line.startswith("    python ")]
    assert len(commands) == len(rows)
    for run in default_runs():  # every row, by its label, and its script in a command
        assert any(line.startswith(f"[{run.series}] {run.label}") for line in rows), run.label
    assert any(" --throughput_report " in c and " device " in c and " short_opt " in c
               for c in commands)
    for script in ("roofline", "cl_compile_repro", "fp8_linears"):  # each writes its JSON
        line = next(c for c in commands if c.startswith(f"python benchmarks/{script}.py "))
        assert re.search(r" --json \S+/report\.json$", line), line
    # a second run of the ViT's optimised config, the same command but for its run directory
    opt = [c for r, c in zip(rows, commands) if r.startswith("[vit] ") and "short_opt" in c]
    assert len(opt) == 2
    strip = [re.sub(r" --throughput_report| --expdir \S+", "", c) for c in opt]
    assert strip[0] == strip[1]
    make = next(line for line in printed if line.startswith("data needed"))
    assert ("cosmology boxes of sides 256 and 128; ERA5 files of 200 and 48 steps of 360 x 720 "
            f"under {data}") in make
    # The call fits the budget and runs every run of the plan once.
    total = next(line for line in printed if line.startswith("estimated: "))
    assert float(re.search(r"estimated: (\d+) s", total).group(1)) < gpu_runs.BUDGET_S <= 540
    assert sorted(run.key for run in default_runs()) == sorted(gpu_runs.RUNS)
    assert not data.exists() and not (tmp_path / "out").exists()  # nothing made or written
    assert not any("DDP" in line or "NCCL" in line for line in printed)


def test_every_train_command_is_a_valid_config_for_its_script(tmp_path):
    seen = set()
    for i, run in enumerate(all_runs()):
        if run.kind == "report":  # a benchmark script (its own tests run it)
            assert os.path.exists(os.path.join(ROOT, run.script)), run.script
            continue
        cmd = gpu_runs.command(run, str(tmp_path), str(tmp_path / f"run{i}"))
        script = cmd[1]
        assert script == "train.py" and os.path.exists(
            os.path.join(ROOT, script))
        cfg = from_argv(cmd[2:], f"{ROOT}/config/ViT.yaml", prog=script)
        model = {"cosmo": "unet", "era5": "vit", None: "vit"}[run.data]
        assert cfg.model == model
        assert cfg.data_is_generated if run.data is None else \
            cfg.data_root == str(tmp_path / run.data)
        assert cfg.expdir == str(tmp_path / f"run{i}")
        assert cfg.throughput_report == ("--throughput_report" in run.args)
        if run.key.startswith("unet/short_opt"):  # the GPU runs' epochs
            assert (cfg.Nsamples, cfg.num_epochs, cfg.global_batch_size) == (1536, 3, 64)
        seen.add((run.key, cfg.amp_mode, cfg.data_loader_config, cfg.enable_fused,
                  cfg.enable_jit, cfg.num_data_workers, script))
    got = {key: rest for key, *rest in seen}
    # The tutorial's optimised configs (the U-Net's with the device loader).
    assert got["unet/short_opt"] == [
        "fp16", "device", True, True, 8, "train.py"]
    assert got["vit/short_opt"] == got["vit/short_opt_again"] == [
        "bf16", "lowmem", True, True, 8, "train.py"]
    # short_opt is the config of its name, but in bf16.
    opt = build_config(f"{ROOT}/config/UNet.yaml", "short_opt", {})
    assert (opt.amp_mode, opt.enable_fused, opt.enable_jit, opt.num_data_workers) == (
        "fp16", True, True, 8)


def test_the_tutorial_figures_name_rows_of_the_plan():
    keys = {run.key for run in all_runs()}
    assert set(gpu_runs.TUTORIAL) <= keys
    assert all(src for _, src in gpu_runs.TUTORIAL.values())


# ------------------------------------------------------------------------------ the data

def test_data_maker_writes_files_the_project_loaders_read(tmp_path):
    out = str(tmp_path / "data")
    lines = []
    gpu_data.make(out, ("cosmo", "era5"), cosmo=(20, 12), era5_steps=(6, 4), era5_size=(16, 32),
                  log=lines.append)
    assert [line.split()[1] for line in lines] == ["cosmo", "era5"]
    assert gpu_data.has_cosmo(out, (20, 12)) and not gpu_data.has_cosmo(out, (256, 128))
    assert gpu_data.has_era5(out, (6, 4), (16, 32))
    # ERA5: the ViT's lowmem loader reads the year files; stats are finite and positive.
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", {
        "data_root": f"{out}/era5", "img_size": "[16,32]", "synthesize_if_missing": "false",
        "expdir": str(tmp_path / "logs")})
    loaders = build_loaders(cfg, 1, 0, 2, CPU)
    assert (loaders.n_train, loaders.n_valid) == (5, 3)
    for which, n in (("train", 2), ("valid", 2)):
        x, y = next(iter(getattr(loaders, which)))
        assert x.shape == y.shape == (n, 20, 16, 32) and x.dtype == torch.float32
        assert torch.isfinite(x).all() and torch.isfinite(y).all()
    means, stds = load_stats(f"{out}/era5", 20)
    assert np.isfinite(means).all() and (stds > 0).all()
    # Cosmology: the U-Net's lowmem and device loaders cut crops from both boxes.
    for mode in ("lowmem", "device"):
        cfg = build_config(f"{ROOT}/config/UNet.yaml", "short", {  # its file names
            "data_root": f"{out}/cosmo", "Nsamples": "6", "Nsamples_val": "3",
            "data_loader_config": mode, "num_data_workers": "0", "expdir": str(tmp_path)})
        cfg = dataclasses.replace(cfg, data_size=8)  # crops of 8 (the model's checks aside)
        loaders = build_loaders(cfg, 1, 0, 3, CPU)
        for which in ("train", "valid"):
            x, y = next(iter(getattr(loaders, which)))
            assert x.shape == (3, 4, 8, 8, 8) and y.shape == (3, 5, 8, 8, 8)
            assert torch.isfinite(x).all() and y.abs().max() <= 0.95
    # Made once: a second call keeps the files.
    before = os.path.getmtime(gpu_data.era5_paths(out)[0])
    lines.clear()
    gpu_data.make(out, ("cosmo", "era5"), cosmo=(20, 12), era5_steps=(6, 4), era5_size=(16, 32),
                  log=lines.append)
    assert all(line.endswith(": kept") for line in lines)
    assert os.path.getmtime(gpu_data.era5_paths(out)[0]) == before
    # Its own files, of other shapes, are written again; anyone else's are refused, untouched.
    gpu_data.make(out, ("era5",), era5_steps=(5, 4), era5_size=(16, 32), log=lines.append)
    assert gpu_data.has_era5(out, (5, 4), (16, 32))
    for n, (kind, where) in enumerate((("era5", lambda d: gpu_data.era5_paths(d)[0]),
                                       ("era5", lambda d: f"{d}/era5/stats/global_means.npy"),
                                       ("cosmo", lambda d: gpu_data.cosmo_paths(d)[1]))):
        root = str(tmp_path / f"other{n}")
        path = where(root)
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(b"a user's file")
        with pytest.raises(ValueError, match=f"{re.escape(path)} exists and was not written by "
                           f"benchmarks.gpu_data: choose another --out, or move it away"):
            gpu_data.make(root, (kind,), cosmo=(20, 12), era5_steps=(6, 4),
                          era5_size=(16, 32), log=lines.append)
        assert open(path, "rb").read() == b"a user's file"


# ------------------------------------------------------------------------------ the parsers

def test_reads_a_real_log_and_its_throughput_report(tmp_path, era5_root):
    """A CPU run of train.py with --throughput_report: its epoch, wait, TFLOP/s, memory and
    throughput lines read back as printed."""
    r = train(TINY_VIT + ["--data_root", era5_root, "--expdir", str(tmp_path), "--num_epochs",
                          "3", "--throughput_report"])
    out = r.stdout + r.stderr
    got = gpu_runs.read_log(out)
    epochs = re.findall(r"Epoch \d+: [\d.]+ s for \d+ steps, ([\d.]+) samples/s", out)
    waits = re.findall(r"Waited for data (\d+)% of the epoch", out)
    assert len(epochs) == len(waits) == 3 and got["epochs"] == [float(v) for v in epochs]
    assert got["samples_per_s"] == pytest.approx((float(epochs[1]) + float(epochs[2])) / 2)
    assert got["wait_pct"] == pytest.approx((float(waits[1]) + float(waits[2])) / 2)
    assert got["tflops"] > 0 and got["mfu"] is None  # no peak table entry for a CPU
    assert got["peak_gb"] is not None
    printed = re.search(r"IO ([\d.]+) \+/- [\d.]+, SYNTHETIC ([\d.]+) \+/- [\d.]+, FULL ([\d.]+)",
                        out).groups()
    assert got["throughput"] == dict(zip(("IO", "SYNTHETIC", "FULL"), map(float, printed)))
    # (a verdict, or on a machine too noisy for one, the line that says so)
    assert got["bottleneck"].startswith(("the ", "none named, the measurement is too noisy"))


def test_reads_gpu_lines_with_their_log_prefix_mfu_wait_report_and_every_rank():
    text = logged(*gpu_epoch(1, 300.0, 40.1, [20.0, 20.5], wait=0.6),
                  *gpu_epoch(2, 400.0, 47.3, [20.1, 21.25], wait=0.3),
                  *gpu_epoch(3, 500.0, 47.3, [20.0, 20.0], wait=0.1),
                  *report_lines(288.0, 1467.0, 313.0))
    assert " - INFO -   Model 47.3 TFLOP/s per device (139.9 GFLOP per sample), MFU 9.6% of 494 " \
           "TFLOP/s peak\n" in text  # the line of a real H100 run, prefix included
    got = gpu_runs.read_log(text)
    assert got["samples_per_s"] == 450.0 and got["epochs"] == [300.0, 400.0, 500.0]
    assert got["wait_pct"] == 20.0 and got["steady_per_s"] == 675.0  # medians of epochs 2, 3
    assert got["tflops"] == 47.3 and got["mfu"] == 9.6  # the last epoch's
    assert got["peak_gb"] == 21.25  # the second rank's, in epoch 2
    assert got["throughput"] == {"IO": 288.0, "SYNTHETIC": 1467.0, "FULL": 313.0}
    assert got["bottleneck"].startswith("the loader is the bottleneck (IO 288.0 < SYNTHETIC")
    big = gpu_runs.read_log(logged(*gpu_epoch(1, 9e3, 1234.5, [1.0])))  # printed as 1.23e+03
    assert big["tflops"] == 1230.0 and big["mfu"] == 249.9 and big["throughput"] is None


def test_reads_the_lines_train_py_logs_with_mfu_and_the_wait(tmp_path, era5_root, monkeypatch):
    """train.py's own epoch lines (log_epoch, its GPU branch: the peak lookup given an H100's
    name), as its log file holds them."""
    import train
    from test_flops import h100_trainer
    from tasks import make_task

    trainer, cfg = h100_trainer(tmp_path, era5_root, monkeypatch)
    val = trainer.validate()
    for epoch, wait in enumerate((0.5, 0.25)):
        trainer.run_log.epoch(train.EpochStats(avg_loss=1.0, elapsed_s=1.0, steps=10,
                                               samples_per_s=8.0e5, steady_samples_per_s=9.0e5,
                                               data_wait=wait), val, 0.1, epoch, trainer.iteration)
    log = open(os.path.join(trainer.run_dir, "out.log")).read()
    tflops = make_task(cfg).flops_per_sample() * 2.0e5 * 4 / 1e12  # 2e5 steps/s of 4 samples on 1 device
    got = gpu_runs.read_log(log)
    assert got["samples_per_s"] == 8e5 and got["wait_pct"] == 25.0  # the second epoch's
    assert got["steady_per_s"] == 9e5
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


# ------------------------------------------------------------------------------ goals

def epochs_log(rate: float) -> str:
    return logged(*gpu_epoch(1, rate / 2, 10.0, [30.0]), *gpu_epoch(2, rate, 20.0, [31.0]))


def result(rate=None, **kw):
    return dict({"samples_per_s": rate, "wait_pct": None, "tflops": None, "mfu": None,
                 "peak_gb": None, "throughput": None}, **kw)


def plan_rows(results: dict) -> list:
    by_key = {run.key: run for run in all_runs()}
    return [(by_key[k], r) for k, r in results.items()]


def test_goals_on_synthetic_results():
    rows = plan_rows({
        "unet/short_opt": result(2600.0, throughput={"IO": 9000.0, "SYNTHETIC": 2800.0,
                                                     "FULL": 2600.0}),
        "vit/short_opt": result(150.0, gflop_per_sample=1442.9, peak_tflops=989.0,
                                throughput={"IO": 455.0, "SYNTHETIC": 166.0, "FULL": 150.0}),
        "vit/short_opt_again": result(150.0, epoch_s=[3.5, 0.6, 0.59], start_s=20.0,
                                      first_step_s=8.0, cache_hits=(6, 0)),
    })
    got = {g: (m, v) for g, m, v in gpu_runs.goals(rows)}
    assert got["U-Net short_opt, device loader: >= 2500 samples/s"] == (
        "2600.0 samples/s", "reached")
    assert got["U-Net, device loader: FULL >= 0.9 SYNTHETIC"] == (
        "FULL 2600.0 / SYNTHETIC 2800.0 = 0.93", "reached")
    # 166 samples/s x 1442.9 GFLOP = 239.5 TFLOP/s of 989: 24.2%
    assert got["ViT compute only (short_opt's SYNTHETIC) >= 30% MFU (bf16)"] == (
        "SYNTHETIC 166.0 samples/s x 1442.9 GFLOP = MFU 24.2%", "not reached")
    assert got["ViT compute only (short_opt's SYNTHETIC) >= 35% MFU (bf16; the moonshot)"][1] \
        == "not reached"
    assert got["ViT, 8 workers (short_opt): FULL >= 0.9 SYNTHETIC"] == (
        "FULL 150.0 / SYNTHETIC 166.0 = 0.90", "reached")
    assert got["ViT, a second run: first epoch <= 2 x steady + 5 s"] == (
        "first epoch 3.5 s, steady 0.59 s: limit 6.2 s; start 20 s, first step 8 s; compile "
        "caches 6 hits, 0 misses", "reached")
    rows = plan_rows({"vit/short_opt_again": result(150.0, epoch_s=[9.0, 1.3, 1.3])})
    assert gpu_runs.goals(rows) == [("ViT, a second run: first epoch <= 2 x steady + 5 s",
                                     "first epoch 9.0 s, steady 1.30 s: limit 7.6 s",
                                     "not reached")]
    # A goal's row that failed is "not measured"; goals of rows not in this call are left out.
    rows = plan_rows({"vit/short_opt": {"failed": "exit 2: error: out of memory"}})
    assert gpu_runs.goals(rows) == [
        ("ViT compute only (short_opt's SYNTHETIC) >= 30% MFU (bf16)",
         "- (exit 2: error: out of memory)", "not measured"),
        ("ViT compute only (short_opt's SYNTHETIC) >= 35% MFU (bf16; the moonshot)",
         "- (exit 2: error: out of memory)", "not measured"),
        ("ViT, 8 workers (short_opt): FULL >= 0.9 SYNTHETIC", "- (exit 2: error: out of memory)",
         "not measured")]


def test_report_rows_their_sections_and_goals(tmp_path):
    """The benchmark scripts' JSON (roofline, compiled channels-last, fp8) as the goals read it,
    and each one's markdown as a section of GPU.md; a script that wrote no JSON is a failed row
    with its last line, one whose verdict is a failure is still a result."""
    roofline = {"markdown": "**unet** table", "models": [
        {"model": "vit", "batch": 16, "roofline_ms": 40.0},
        {"model": "unet", "batch": 64, "roofline_ms": 16.0}]}  # 4000 samples/s at the floor
    repro = {"markdown": "eager: ...\ncompiled: no result within 90 s", "works": False,
             "lines": ["eager: forward + backward in 3.0 s", "compiled: no result within 90 s"]}
    fp8 = {"markdown": "| linears |", "rows": [
        {"recipe": "none", "ms": 100.0, "speedup": 1.0},
        {"recipe": "tensorwise", "ms": 80.0, "speedup": 1.25},
        {"recipe": "rowwise", "failed": "skipped: budget spent"}]}
    results = {}
    for key, report in (("roofline/models", roofline), ("cl/repro", repro), ("fp8/mp", fp8)):
        path = tmp_path / f"{key.replace('/', '_')}.json"
        path.write_text(json.dumps(report))
        results[key] = gpu_runs.outcome(1 if key == "cl/repro" else 0, "", 10.0, str(path))
        assert results[key] == {"report": report}
    results["unet/short_opt"] = result(2000.0)
    got = {g: (m, v) for g, m, v in gpu_runs.goals(plan_rows(results))}
    assert got["U-Net short_opt, device loader: >= 0.8 of the roofline's rate"] == (
        "2000.0 samples/s; the roofline's step 16.0 ms for 64: 4000 samples/s; 0.50 of it",
        "not reached")
    assert got["Compiled channels-last (torch alone): eager's numbers within its limit"] == (
        "compiled: no result within 90 s", "not reached")
    assert got["fp8 linears, mp ViT, compiled: >= 1.15x bf16"] == (
        "fp8 tensorwise: 80.0 ms/step, 1.250x bf16", "reached")
    doc = gpu_runs.document(["header"], plan_rows(results))
    for report in (roofline, repro, fp8):
        assert report["markdown"] in doc
    assert "## Roofline: each model's eager step" in doc
    # no JSON written: a failed row with the output's last line (or the timeout)
    missing = str(tmp_path / "none.json")
    assert gpu_runs.outcome(1, "Traceback\nValueError: bad", 10.0, missing) == {
        "failed": "exit 1, no result written: ValueError: bad"}
    assert gpu_runs.outcome(None, "x", 10.0, missing)["failed"].startswith(
        "timed out after 10 s")


def test_table_speed_ups_tutorial_ratio_and_special_rows():
    third = dataclasses.replace(gpu_runs.RUNS["vit/short_opt_again"], key="vit/third",
                                label="third")
    rows = plan_rows({
        "unet/short_opt": result(2596.8, wait_pct=60.0, tflops=40.1, mfu=8.1, peak_gb=20.5),
        "vit/short_opt": result(21.42),
        "vit/short_opt_again": {"failed": "exit 1: a|b"},
    }) + [(third, result(42.84, start_s=12.4, first_step_s=5.2, epoch_s=[2.0, 1.0],
                         cache_hits=(3, 0)))]
    lines = gpu_runs.table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]
    assert cells[0] == ["unet", gpu_runs.RUNS["unet/short_opt"].label, "2596.8", "-", "1.00x",
                        "60%", "40.1", "8.1%", "20.50", "519.2", "5.00x", ""]
    assert cells[1][2:5] == ["21.4", "-", "1.00x"] and cells[1][9:11] == ["42.8", "0.50x"]
    assert cells[2][2] == "failed: exit 1: a\\|b" and cells[2][3:] == ["-"] * 9
    assert cells[3][2:5] == ["42.8", "-", "2.00x"]  # the row before failed: no 'vs prev'
    assert cells[3][-1] == ("start 12 s (first step 5 s); first epoch 2.0 s; compile caches 3 "
                            "hits, 0 misses")
    doc = gpu_runs.document(["header"], rows)
    assert "## The tutorials' A100-40GB figures" in doc and "- unet/short_opt: 519.2 samples/s" in doc


# ------------------------------------------------------------------------------ main()

@pytest.fixture
def fake_gpu(monkeypatch):
    """main() past its GPU check on this CPU machine; the runs themselves still run for real."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def runs(tmp_path) -> dict:
    """key -> Run printing an H100's log, one that crashes with a traceback, a real train.py
    refusing a setting and one that hangs."""
    log, replay, sleeper = tmp_path / "gpu.log", tmp_path / "replay.py", tmp_path / "sleeper.py"
    crash = tmp_path / "crash.py"
    crash.write_text("print('step 1')\nraise RuntimeError('CUDA error: an illegal memory access')\n")
    log.write_text(logged(*gpu_epoch(1, 300.0, 40.1, [20.0]), *gpu_epoch(2, 400.0, 47.3, [21.5]),
                          *report_lines(450.0, 500.0, 400.0)))
    replay.write_text("import sys\nsys.stdout.write(open(sys.argv[1]).read())\n")
    sleeper.write_text(SLEEPER)
    return {"replayed": Run("tiny/replayed", "replayed", str(replay), (str(log),), 10),
            "crashes": Run("tiny/crashes", "crashes", str(crash), (), 10),
            "bad setting": Run("tiny/bad", "bad setting", "train.py",
                               tuple(TINY_VIT + ["--amp_mode", "bogus"]), 10),
            "hangs": Run("tiny/hangs", "hangs", str(sleeper), (str(tmp_path / "child.pid"),), 10),
            "long": Run("tiny/long", "long", str(replay), (str(log),), 10_000)}


def test_failed_timed_out_and_skipped_runs_are_rows_saying_why(tmp_path, fake_gpu, monkeypatch,
                                                              capsys):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))  # the default --out-dir
    plan(monkeypatch, {"tiny": [runs(tmp_path)[k] for k in (
        "replayed", "crashes", "hangs", "long")]})
    out.mkdir()
    (out / "GPU.md").write_text("kept")
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["--timeout", "3"])
    assert e.value.code == 1
    assert time.monotonic() - t0 < 60  # the sleeper's child did not hold the pipe for 120 s
    child = f"/proc/{(tmp_path / 'child.pid').read_text()}/stat"
    state = open(child).read().split()[2] if os.path.exists(child) else "gone"
    assert state in ("Z", "X", "gone")  # killed with its parent
    assert (out / "GPU.md").read_text() == "kept"
    doc = (out / "GPU_2.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| tiny |")]
    assert rows[0] == ("| tiny | replayed | 400.0 | - | 1.00x | 41% | 47.3 | 9.6% | 21.50 | - | - "
                       "| first epoch 6.3 s; FULL/SYNTHETIC 0.80 |")
    assert rows[1] == ("| tiny | crashes | failed: exit 1: RuntimeError: CUDA error: an illegal "
                       "memory access |" + " - |" * 9)
    assert rows[2] == ("| tiny | hangs | failed: timed out after 3 s; last line: loading the data "
                       "|" + " - |" * 9)
    assert re.match(r"\| tiny \| long \| not run: \d+ s left of the 540 s --budget, about 10000 s "
                    r"needed \|", rows[3])
    assert "| tiny: replayed | 450.0 | 500.0 | 400.0 | 0.80 | the loader is the bottleneck" in doc
    assert doc.splitlines()[2].startswith("NVIDIA H100 80GB HBM3; torch ")
    log = (out / "gpu_runs.log").read_text()
    assert log.count("==== [tiny] ") == 3  # the skipped run is not in it
    saved = json.loads((out / "gpu_runs.json").read_text())
    assert [r["key"] for r in saved["rows"]] == ["tiny/replayed", "tiny/crashes", "tiny/hangs",
                                                 "tiny/long"]
    captured = capsys.readouterr()
    assert "    failed: exit 1: RuntimeError" in captured.out and "written: " in captured.out
    assert captured.out.index("## Runs") > captured.out.index("written: ")  # the table, last
    assert ("error: 2 of 4 runs failed, 1 skipped" in captured.err
            and "run the skipped ones again with --only tiny" in captured.err)


@pytest.mark.parametrize("broken, timeout, says", [
    ("bad setting", "60", "the first failure, [tiny] bad setting: exit 2: error: amp_mode='bogus'"),
    ("hangs", "1", "all 1 runs timed out after 1 s: raise --timeout")])
def test_nothing_succeeded_writes_nothing_and_says_what_to_fix(tmp_path, fake_gpu, monkeypatch,
                                                               broken, timeout, says):
    plan(monkeypatch, {"tiny": [runs(tmp_path)[broken]]})
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["--out-dir", str(out), "--timeout", timeout])
    assert str(e.value.code).startswith("error: ") and says in str(e.value.code)
    assert str(e.value.code).endswith("nothing written")
    assert not (out / "GPU.md").exists() and not (out / "gpu_runs.json").exists()


def test_make_data_then_run(tmp_path, fake_gpu, monkeypatch, capsys):
    """Data a run reads is made first with --make-data; without it, missing data stops the call
    before any run."""
    run = runs(tmp_path)["replayed"]
    plan(monkeypatch, {"tiny": [Run("tiny/cosmo", "reads cosmo",
                                                          run.script, run.args, 10,
                                                          data="cosmo")]})
    data, out = tmp_path / "data", tmp_path / "out"
    args = ["--data", str(data), "--out-dir", str(out), "--cosmo", "12", "8"]
    with pytest.raises(SystemExit, match=r"^error: no cosmo data of the planned sizes under .*: "
                                         r"add --make-data"):
        gpu_runs.main(args)
    assert not out.exists()
    gpu_runs.main(args + ["--make-data"])
    assert gpu_data.has_cosmo(str(data), (12, 8))
    doc = (out / "GPU.md").read_text()
    assert re.search(r"under a 540 s budget; data made in [\d.]+ s", doc)
    assert "| tiny | reads cosmo | 400.0 |" in doc
    assert f"--data_root {data}/cosmo --expdir " in (out / "gpu_runs.log").read_text()
    assert "data: cosmo written in " in capsys.readouterr().out


def forked_run_logged(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """``gpu_runs.run_logged``'s (exit code or None, output), the command forked from the
    preloaded server."""
    try:
        r = preloaded.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          start_new_session=True)
    except subprocess.TimeoutExpired as e:
        return None, e.output or ""
    return r.returncode, r.stdout


def test_report_rows_run_their_scripts_and_become_sections(tmp_path, fake_gpu, monkeypatch):
    """The three benchmark scripts run as the GPU call runs them (here at their CPU sizes):
    each writes its JSON where the call says, its markdown is a section of GPU.md, and the
    goals read the channels-last verdict (a compile that fails is a result: "not reached") and
    the fp8 ratio."""
    tiny = ("--width", "2", "--max-width", "4", "--side", "16", "--batch", "2")
    small = {"roofline/models": ("--small", "--budget", "60"),
             "cl/repro": tiny + ("--backend", "no_such_backend"),
             "fp8/mp": ("--small", "--steps", "1", "--rounds", "2")}
    reports = [dataclasses.replace(gpu_runs.RUNS[k], args=a) for k, a in small.items()]
    plan(monkeypatch, {"reports": reports})
    # The scripts are forked from the preloaded server (tests/preloaded.py), torch loaded once
    # instead of in each: the command lines, outputs and JSON files are the call's own. How a
    # run is started, timed out and killed: test_failed_timed_out_and_skipped_runs_are_rows_...
    # and test_a_sigterm_kills_the_run_in_flight_and_keeps_the_rows.
    monkeypatch.setattr(gpu_runs, "run_logged", forked_run_logged)
    out = tmp_path / "out"
    gpu_runs.main(["--out-dir", str(out)])
    doc = (out / "GPU.md").read_text()
    for section in ("## Roofline: each model's eager step",
                    "## Compiled channels-last U-Net levels, torch alone",
                    "## Linears in fp8 (tensorwise) against bf16"):
        assert section in doc
    assert "| **total** |" in doc and "compiled: FAILED: InvalidBackend" in doc
    assert "| fp8 tensorwise |" in doc
    goals = doc.split("## Goals")[1]
    assert "| Compiled channels-last (torch alone): eager's numbers within its limit | compiled: " \
           "FAILED: InvalidBackend" in goals and "| not reached |" in goals
    assert re.search(r"\| fp8 linears, mp ViT, compiled: >= 1\.15x bf16 \| fp8 tensorwise: "
                     r"[\d.]+ ms/step, [\d.]+x bf16 \| (not )?reached \|", goals)
    rows = json.loads((out / "gpu_runs.json").read_text())["rows"]
    assert [r["key"] for r in rows] == ["roofline/models", "cl/repro", "fp8/mp"]
    assert all("report" in r for r in rows)


TERMINATOR = """import os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
os.kill(os.getppid(), signal.SIGTERM)  # the call's time limit, from outside
time.sleep(120)
"""


def test_a_sigterm_kills_the_run_in_flight_and_keeps_the_rows(tmp_path, fake_gpu, monkeypatch):
    script, pid = tmp_path / "terminator.py", tmp_path / "run.pid"
    script.write_text(TERMINATOR)
    before = signal.getsignal(signal.SIGTERM)
    plan(monkeypatch, {"tiny": [
        runs(tmp_path)["replayed"], Run("tiny/term", "terminated", str(script), (str(pid),), 10)]})
    out = tmp_path / "out"
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="^error: terminated"):
        gpu_runs.main(["--out-dir", str(out)])
    assert time.monotonic() - t0 < 60
    stat = f"/proc/{pid.read_text()}/stat"
    assert (open(stat).read().split()[2] if os.path.exists(stat) else "gone") in ("Z", "X", "gone")
    assert "| tiny | replayed | 400.0 |" in (out / "GPU.md").read_text()  # the row before it
    assert signal.getsignal(signal.SIGTERM) == before


def test_budget_gives_timeouts_and_skips():
    now = [0.0]
    budget = gpu_runs.Budget(100.0, clock=lambda: now[0])
    assert budget.timeout(30, 200) == 100.0 and budget.timeout(30, 50) == 50
    now[0] = 70.0
    assert budget.timeout(40, 200) == 30.0  # half the estimate is left: it runs, cut to 30 s
    assert budget.timeout(80, 200) is None  # less than half: skipped
    now[0] = 85.0
    assert budget.timeout(1, 200) is None  # under MIN_RUN_S
    assert budget.skipped(80) == {"skipped": "not run: 15 s left of the 100 s --budget, about "
                                             "80 s needed"}


def test_refuses_without_a_gpu_and_changes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["--out-dir", str(out), "--make-data", "--data", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: no CUDA GPU here") and err.count("\n") == 1
    assert not out.exists() and not (tmp_path / "d").exists()
    for bad, says in ((["--timeout", "0"], "argument --timeout: 0 is below 1.0"),
                      (["--budget", "-1"], "argument --budget: -1 is below 1.0"),
                      (["--cosmo", "1", "8"], "argument --cosmo: 1 is below 2")):
        with pytest.raises(SystemExit) as e:
            gpu_runs.main(["--out-dir", str(out)] + bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {says}") and err.count("\n") == 1


def test_the_data_makers_refusal_is_one_line_and_changes_nothing(tmp_path, fake_gpu, capsys):
    taken = tmp_path / "d" / "era5" / "train" / "2014.h5"
    taken.parent.mkdir(parents=True)
    taken.write_bytes(b"a user's file")
    with pytest.raises(SystemExit) as e:
        gpu_runs.main(["--make-data", "--only", "vit/short_opt", "--data", str(tmp_path / "d"),
                       "--era5-steps", "4", "2", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {taken} exists and was not written")
    assert taken.read_bytes() == b"a user's file" and not (tmp_path / "out").exists()


def test_reads_the_start_lines_as_train_py_wraps_them(monkeypatch):
    from observe import profiling
    from observe.profiling import StartClock
    monkeypatch.setattr(profiling, "compile_cache_counts", lambda: (3, 1))  # not this process's
    now = [0.0]
    clock = StartClock(start=-31.4, clock=lambda: now[0])
    for name, t in [("imports and set-up", 0.0), ("data", 2.1), ("model", 3.5), ("loaders", 3.7),
                    ("optimizer and logs", 3.8), ("first batch", 4.1), ("first step", 25.2)]:
        now[0] = t
        clock.mark(name)
    clock.compile_dir = "/tmp/cache"
    text = logged(*clock.lines(), *gpu_epoch(1, 100.0, 50.0, [9.0]))
    assert len(text.splitlines()[1]) <= 150 and "first step 21.1 s" in text
    r = gpu_runs.read_log(text)
    assert (r["start_s"], r["first_step_s"], r["cache_hits"]) == (56.6, 21.1, (3, 1))
