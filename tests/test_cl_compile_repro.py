"""benchmarks/cl_compile_repro.py on the CPU: the versions first, then one line per phase: the
compiled channels-last U-Net trains the eager numbers, a compile past its limit says so, and a
failure prints its exception's first line."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = f"{ROOT}/benchmarks/cl_compile_repro.py"
TINY = ["--width", "2", "--max-width", "4", "--side", "16", "--batch", "2"]


def repro(*args, timeout=600):
    p = subprocess.run([sys.executable, SCRIPT, *TINY, *args], capture_output=True, text=True,
                       timeout=timeout, cwd="/")  # torch alone: runs from anywhere
    return p.returncode, p.stdout.splitlines()


@pytest.mark.compile
def test_the_compiled_channels_last_step_gives_the_eager_numbers_on_a_cpu():
    rc, lines = repro("--timeout", "400")
    assert lines[0].startswith("torch ") and ", CUDA " in lines[0] and ", cuDNN " in lines[0]
    assert "4 levels, widths 2..4" in lines[1] and "channels_last_3d" in lines[1]
    assert lines[2].startswith("eager: forward + backward in ")
    assert lines[3].startswith("compiled: compiled and ran in ") and "same numbers" in lines[3]
    assert rc == 0


@pytest.mark.compile
def test_a_compile_past_its_limit_is_no_result_within_it():
    rc, lines = repro("--timeout", "2", "--eager-timeout", "120")
    assert lines[-1] == "compiled: no result within 2 s"
    assert rc == 1


def test_a_failure_is_its_exceptions_first_line(tmp_path):
    rc, lines = repro("--backend", "no_such_backend", "--json", str(tmp_path / "v.json"))
    assert lines[-1].startswith("compiled: FAILED: InvalidBackend: Invalid backend: "
                                "'no_such_backend'")
    assert rc == 1
    written = json.loads((tmp_path / "v.json").read_text())  # what benchmarks/gpu_runs reads
    assert written["works"] is False and written["lines"] == lines[-2:]
    assert written["markdown"] == "```\n" + "\n".join(lines) + "\n```"


def test_bad_input_is_one_line_and_an_existing_json_is_kept(tmp_path):
    kept = tmp_path / "v.json"
    kept.write_text("earlier verdicts")
    for args, says in ((["--json", str(kept)], f"--json {kept} exists: choose another name"),
                       (["--side", "12"], "--side 12: must be a power of 2"),
                       (["--batch", "0"], "--batch must be 1 or more")):
        p = subprocess.run([sys.executable, SCRIPT, *TINY, *args], capture_output=True, text=True,
                           timeout=120, cwd="/")
        assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith("error: ") and says in p.stderr, p.stderr
    assert kept.read_text() == "earlier verdicts"


def test_the_root_cause_of_a_chained_exception():
    sys.path.insert(0, f"{ROOT}/benchmarks")
    try:
        from cl_compile_repro import first_line
    finally:
        sys.path.remove(f"{ROOT}/benchmarks")
    try:
        try:
            raise AssertionError("expected size 512==512, stride 64==1 at dim=1\nmore")
        except AssertionError as e:
            raise RuntimeError("backend='inductor' raised:\n...") from e
    except RuntimeError as e:
        assert first_line(e) == ("AssertionError: expected size 512==512, stride 64==1 at "
                                 "dim=1 (raised as RuntimeError)")
