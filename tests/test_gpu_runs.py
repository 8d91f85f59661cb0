"""benchmarks/gpu_runs.py without a GPU: its commands parse, it reads train.py's real log lines,
its table, and its refusal."""
import pytest

from benchmarks import gpu_runs
from conftest import ROOT
from test_training import TINY_VIT, train
from utils.config import from_argv


def test_every_command_of_the_sequence_is_a_valid_config():
    for series in gpu_runs.SERIES.values():
        for _, cmd, args in series:
            script = cmd[-1]
            assert script in ("train.py", "train_graph.py", "train_mp.py")
            from_argv(args, f"{ROOT}/config/ViT.yaml", prog=script)


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


def test_refuses_without_a_gpu_and_changes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "GPU.md"
    out.write_text("kept")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="error: no CUDA GPU here"):
        gpu_runs.main(["--out", str(out)])
    assert out.read_text() == "kept"
