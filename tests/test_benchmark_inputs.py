"""Bad input to the benchmark commands: one ``error:`` line on stderr naming the value, exit
code 2, no traceback, refused before any measurement, and nothing on disk changed (an existing
output file is never written over)."""
import argparse
import math
import sys

import pytest

import preloaded
from conftest import ROOT

SCRIPTS = ["stop_agreement", "era5_reads", "generated_batches", "band_reads",
           "checkpoint_memory", "score_speed", "example_runs", "memory_model", "roofline",
           "step_options", "scaling", "throughput"]

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
    "stop_agreement ranks negative": ("stop_agreement", ["--ranks", "-2", "--rounds", "1"],
                                      ["-2", "2 or more"]),
    "stop_agreement ranks not a number": ("stop_agreement", ["--ranks", "abc"], ["abc"]),
    "stop_agreement rounds 0": ("stop_agreement", ["--rounds", "0"], ["--rounds", "0"]),
    "era5_reads band outside the image": ("era5_reads", ["--band", "8", "64", "--img_size",
                                                         "32", "64"], ["--band 8 64", "32"]),
    "era5_reads batch negative": ("era5_reads", ["--batch", "-1"], ["--batch", "-1"]),
    "generated_batches config without yaml": ("generated_batches", ["--configs", "ViT"],
                                              ["--configs ViT", "ViT:short", "UNet:short"]),
    "generated_batches rounds 0": ("generated_batches", ["--rounds", "0"], ["--rounds", "0"]),
    "generated_batches unknown config": ("generated_batches", ["--configs", "ViT:nope"],
                                         ["ViT:nope", "ViT:quickstart"]),
    "band_reads batches 0": ("band_reads", ["--batches", "0"], ["--batches", "0"]),
    "band_reads layout without ranks": ("band_reads", ["--layouts", "0x1"], ["0x1"]),
    "checkpoint_memory depth negative": ("checkpoint_memory", ["--depth", "-1"],
                                         ["--depth", "-1"]),
    "checkpoint_memory width the heads do not divide": ("checkpoint_memory",
                                                        ["--embed_dim", "30"], ["30"]),
    "score_speed unknown config": ("score_speed", ["--config", "nope"], ["nope", "quickstart"]),
    "score_speed n_init negative": ("score_speed", ["--n_init", "-3"], ["--n_init", "-3"]),
    "memory_model memory negative": ("memory_model", ["--gpu_memory_gb", "-5"],
                                     ["--gpu_memory_gb", "-5"]),
    "roofline budget negative": ("roofline", ["--budget", "-1"], ["--budget", "-1"]),
    "step_options malformed overrides": ("step_options",
                                         ["--vit-overrides", '{"img_size": [64, 128]'],
                                         ["--vit-overrides", "img_size", "delimiter"]),
    "step_options overrides not an object": ("step_options", ["--vit-overrides", "[64]"],
                                             ["--vit-overrides", "[64]", "object"]),
    "step_options unknown override": ("step_options", ["--vit-overrides", '{"nope": 1}'],
                                      ["nope"]),
    "step_options steps negative": ("step_options", ["--steps", "-1", "--dry-run"],
                                    ["--steps", "-1"]),
    "scaling retries negative": ("scaling", ["--retries", "-1"], ["--retries", "-1"]),
    "scaling ranks 0": ("scaling", ["--ranks", "1,0"], ["--ranks", "1,0"]),
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
    ("step_options", ["--only", "attention", "--json", "{path}"]),
])
def test_an_existing_output_file_is_refused_and_kept(tmp_path, name, args):
    path = tmp_path / "existing.json"
    path.write_bytes(EXISTING)
    line = refused(bench(name, *(a.format(path=path) for a in args)), str(path))
    assert path.read_bytes() == EXISTING, line
    assert [p.name for p in tmp_path.iterdir()] == ["existing.json"]


@pytest.mark.parametrize("name, args, named", [
    ("score_speed", ["--config", "nope", "--data", "{data}"], ["nope"]),
    ("throughput", ["--before", "no-such-rev", "--data", "{data}"],
     ["--before no-such-rev", "--before none"]),
])
def test_a_refusal_makes_no_data_directory(tmp_path, name, args, named):
    refused(bench(name, *(a.format(data=tmp_path / "data") for a in args)), *named)
    assert list(tmp_path.iterdir()) == []


HELP_SAYS = {"band_reads": ["samples/s is the best round"],
             "memory_model": ["in GiB", "fits / does not fit"]}


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


def test_score_speed_times_at_least_one_forward_pass(tmp_path):
    r = bench("score_speed", "--batch", "8", "--n_init", "2", "--lead_steps", "2", "--rounds",
              "1", "--threads", "1", "--data", tmp_path / "data")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "forward: 1 pass of batch 8 = 8 samples per round" in r.stdout, r.stdout
    forward = next(ln.split() for ln in r.stdout.splitlines() if ln.startswith("forward "))
    assert math.isfinite(float(forward[2])), r.stdout  # a rate over work done, not over none


def test_scaling_without_retries_keeps_a_disturbed_point_and_marks_it(monkeypatch, capsys):
    from benchmarks import scaling

    calls = []

    def run_point(model, ranks, local_batch, noddp, work, log_dir, max_wait):
        calls.append(ranks)
        return dict(model=model, ranks=ranks, local_batch=local_batch, noddp=noddp,
                    global_batch=local_batch * ranks, samples_per_s=10.0 * ranks,
                    others_during=0.5 if ranks == 2 else 0.0)

    monkeypatch.setattr(scaling, "run_point", run_point)
    args = argparse.Namespace(retries=0, disturbed=0.1, max_wait=0)
    results = [scaling.measure(p, args, "work", "logs") for p in scaling.plan(["vit"], [1, 2])]
    out = capsys.readouterr().out
    assert len(calls) == len(results) and "running it again" not in out
    assert "no retries left (--retries 0)" in out and "kept" in out
    assert [r["disturbed"] for r in results] == [r["ranks"] == 2 for r in results]
    table = scaling.tables(results, cores=2)
    assert "| 2 | 16 | 20.0 (disturbed) |" in table and "| 1 | 8 | 10.0 |" in table, table
    assert "(disturbed): other processes" in table

    args.retries = 1  # a retry left: run again, then kept as disturbed
    calls.clear()
    r = scaling.measure(("vit", 2, 8, False), args, "work", "logs")
    assert calls == [2, 2] and r["attempts"] == 2 and r["disturbed"]
    assert "running it again" in capsys.readouterr().out


def test_era5_reads_times_the_read_path_before_reads_by_offset(monkeypatch, capsys):
    from benchmarks import era5_reads

    before = era5_reads.old_module()
    assert before.__file__.endswith("utils/era5_data.py") and before.ERA5Dataset.read_batch
    # the h5py read path: none of the reads by offset that the working tree's module has
    assert hasattr(era5_reads.era5_data, "read_pieces") and not hasattr(before, "read_pieces")
    assert "utils" not in sys.modules  # that commit's package imported under its names only
    assert "4635056" in era5_reads.__doc__ and "HEAD:" not in era5_reads.__doc__

    monkeypatch.setattr(era5_reads, "BEFORE", "0" * 40)
    with pytest.raises(SystemExit) as e:
        era5_reads.old_module()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the 'read_batch before' rows need commit 0000000") \
        and err.count("\n") == 1, err
