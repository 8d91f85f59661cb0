"""Bad input to the benchmark commands: one ``error:`` line on stderr naming the value, exit
code 2, no traceback, refused before any measurement, and nothing on disk changed (an existing
output file is never written over)."""
import sys

import pytest

import preloaded
from conftest import ROOT

SCRIPTS = ["example_runs", "memory_model", "roofline", "scaling", "throughput"]

EXISTING = b'{"kept": "as it was"}\n'


def bench(name, *args):
    """``python -m benchmarks.<name> args``, forked from the preloaded server (tests/preloaded.py:
    torch is loaded there once, not in every case)."""
    return preloaded.run([sys.executable, "-m", f"benchmarks.{name}", *map(str, args)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)


def refused(r, *named):
    """The one ``error:`` line of an exit 2, naming each of ``named``; the line."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and r.stderr.endswith("\n"), r.stderr
    assert lines[0].startswith("error: "), lines
    for value in named:
        assert value in lines[0], (value, lines[0])
    return lines[0]


BAD = {
    "memory_model memory negative": ("memory_model", ["--gpu_memory_gb", "-5"],
                                     ["--gpu_memory_gb", "-5"]),
    "roofline budget negative": ("roofline", ["--budget", "-1"], ["--budget", "-1"]),
    "scaling repeats 0": ("scaling", ["--repeats", "0"], ["--repeats", "0"]),
    "scaling ranks 0": ("scaling", ["--ranks", "1,0"], ["--ranks", "1,0"]),
    "scaling ranks not a number": ("scaling", ["--ranks", "1,abc"], ["abc"]),
    "scaling unknown model": ("scaling", ["--models", "vit,vti"], ["vti", "unet"]),
    "throughput workers negative": ("throughput", ["--workers", "0", "-1"], ["--workers", "-1"]),
    "throughput batches 0": ("throughput", ["--batches", "0"], ["--batches", "0"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_value_is_one_error_line(case):
    name, args, named = BAD[case]
    refused(bench(name, *args), *named)


@pytest.mark.parametrize("name, args", [
    ("example_runs", ["--out", "{path}"]),
    ("example_runs", ["--out", "{path}", "--plot-only"]),
    ("roofline", ["--small", "--only", "vit", "--json", "{path}"]),
])
def test_an_existing_output_file_is_refused_and_kept(tmp_path, name, args):
    path = tmp_path / "existing.json"
    path.write_bytes(EXISTING)
    line = refused(bench(name, *(a.format(path=path) for a in args)), str(path))
    assert path.read_bytes() == EXISTING, line
    assert [p.name for p in tmp_path.iterdir()] == ["existing.json"]


HELP_SAYS = {"memory_model": ["in GiB", "fits / does not fit"]}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_still_exits_0(name):
    r = bench(name, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:") and not r.stderr, r.stderr
    text = " ".join(r.stdout.split())
    assert all(words in text for words in HELP_SAYS.get(name, [])), text
    assert "(mean)" not in text


@pytest.mark.parametrize("memory, verdict", [(80, "of 80 GiB: fits)"),
                                             (0.1, "of 0.1 GiB: does not fit)")])
def test_memory_model_gives_its_verdict(capsys, memory, verdict):
    from benchmarks import memory_model

    memory_model.main(["--config", "mp_cpu", "--gpu_memory_gb", str(memory)])
    assert verdict in capsys.readouterr().out
