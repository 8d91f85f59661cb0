"""``--help`` shows what would run; every command-line tool describes every option."""
import argparse
import dataclasses
import importlib
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from settings.config import CONFIG_CLASSES, identity_fields
from settings.parse import build_config
from settings.cli import settings_help


def help_of(*args, script="train.py"):
    r = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_help_shows_the_chosen_config_with_its_values_and_the_overrides():
    text = help_of("--yaml_config", "config/UNet.yaml", "--config", "short", "--lr", "3e-4",
                   "--help")
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "short", {"lr": "3e-4"})
    assert "config 'short' of config/UNet.yaml (unet)" in text
    assert "--lr float = 0.0003 *" in text  # the override, marked as not the built-in default
    assert f"--num_epochs int or null = {cfg.num_epochs} *" in text
    assert "--amp_mode {none,fp16,bf16} = none\n" in text
    assert "--base_width int = 64" in text and "--embed_dim" not in text  # U-Net settings only
    assert "base, short, short_opt, quickstart" in text  # the configs of the file
    assert "--enable_benchy" in text and "= --throughput_report true" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    settings = re.findall(r"^  --(\w+) ", text.split("Spellings kept")[1], re.M)
    aliases = {"enable_amp", "enable_apex", "enable_benchy", "row_parallel_size",
               "data_loader_config"}
    own = [s for s in settings if s not in aliases or s == "data_loader_config"]
    fields = [f.name for f in dataclasses.fields(CONFIG_CLASSES["unet"])
              if f.name not in identity_fields(CONFIG_CLASSES["unet"])]
    assert sorted(set(own)) == sorted(fields)
    assert len([s for s in own if s != "data_loader_config"]) == len(fields) - 1  # each once


def test_help_of_the_default_config_and_of_train_mp():
    text = help_of("--help")
    assert "config 'quickstart' of" in text and "(vit)" in text and "--embed_dim int = 128 *" in text
    mp = help_of("--config", "mp", "-h", script="train_mp.py")
    assert mp.startswith("usage: python train_mp.py") and "--tensor_parallel int = " in mp


def test_help_with_a_bad_config_is_the_one_line_error():
    r = subprocess.run([sys.executable, "train.py", "--config", "nope", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: --config nope") and not r.stdout


def test_every_setting_is_under_a_group_header():
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "mp", {})
    text = settings_help(cfg)
    headers = re.findall(r"^(\S.*):$", text, re.M)
    assert "Data" in headers and "Optimisation" in headers and "ViT settings" in headers


TOOLS = ["datapipe.synthetic", "benchmarks.throughput", "benchmarks.memory_model",
         "benchmarks.scaling", "benchmarks.example_runs", "benchmarks.gpu_runs", "score"]


@pytest.mark.parametrize("module", TOOLS)
def test_every_option_of_every_tool_has_a_description(module, monkeypatch):
    missing = []
    original = argparse.ArgumentParser.add_argument

    def noting(self, *args, **kwargs):
        if args[0] not in ("-h", "--help") and not kwargs.get("help"):
            missing.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "add_argument", noting)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--help"])
    assert e.value.code == 0
    assert not missing, f"{module}: options without help: {missing}"


TORCH_LOADED = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("torch loaded:", "torch" in sys.modules, file=sys.stderr)
"""


BAD_SETTING = (["--lr", "fast"], "error: lr='fast' is not a number")
BAD_OPTION = {"score.py": (["--run", "nowhere"], "error: --run nowhere: no such run directory")}


@pytest.mark.parametrize("script", ["train.py", "train_mp.py", "train_graph.py", "score.py"])
@pytest.mark.parametrize("wrong", [True, False], ids=["bad", "help"])
def test_bad_settings_and_help_are_answered_before_torch_loads(script, wrong):
    """A mistyped setting (score.py: a --run that does not exist) or --help costs a fraction of a
    second, not the seconds torch and the engine take to load."""
    args, message = BAD_OPTION.get(script, BAD_SETTING) if wrong else (["--help"], None)
    r = subprocess.run([sys.executable, "-c", TORCH_LOADED, script, *args], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == (2 if wrong else 0), r.stderr
    assert r.stderr.endswith("torch loaded: False\n"), r.stderr
    if wrong:
        assert r.stderr.startswith(message) and r.stderr.count("\n") == 2, r.stderr
    else:
        assert script in r.stdout.splitlines()[0], r.stdout[:300]


@pytest.mark.parametrize("args, says", [
    (["benchmarks.memory_model", "--help"], None),
    (["benchmarks.gpu_runs"], "no CUDA GPU here"),
], ids=["memory_model", "gpu_runs"])
def test_benchmarks_run_as_documented_from_the_repository_root(args, says):
    """``python -m benchmarks.X`` from the repository, with nothing added to the path (the
    benchmarks that spawn ranks take the tests' harness): --help works, bad input and a missing
    GPU are one line and exit code 2."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=120)
    if says is None:
        assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
        return
    if says == "no CUDA GPU here":
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is here: the benchmark would run, not refuse")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {says}"), r.stderr
