"""benchmarks/scaling.py --plot-only: redraws from a results file, and without one says so in one
line instead of a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

RESULTS = os.path.join(ROOT, "benchmarks", "scaling", "results.json")


def plot_only(out):
    return subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--plot-only", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_plot_only_without_results_is_one_error_line_and_creates_nothing(tmp_path):
    out = tmp_path / "none"
    r = plot_only(out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(out / "results.json") in lines[0] and "python -m benchmarks.scaling" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("text", ["{not json", '{"results": []}', "[1, 2]"])
def test_plot_only_with_a_foreign_file_is_one_error_line_and_keeps_it(tmp_path, text):
    (tmp_path / "results.json").write_text(text)
    r = plot_only(tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a results file" in lines[0], lines
    assert (tmp_path / "results.json").read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_plot_only_redraws_tables_and_plots_from_results(tmp_path):
    shutil.copy(RESULTS, tmp_path / "results.json")
    r = plot_only(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "**vit, weak scaling**" in r.stdout and "**unet, strong scaling**" in r.stdout
    for name in ("throughput.png", "efficiency.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((tmp_path / "results.json").read_text()) == json.load(open(RESULTS))
