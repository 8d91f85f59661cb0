import subprocess
import sys

import pytest
import yaml

from utils.config import build_config, dump, parse_overrides
from utils.errors import ConfigError

from conftest import ROOT

VIT = f"{ROOT}/config/ViT.yaml"
UNET = f"{ROOT}/config/UNet.yaml"


def test_merge_keys_inherit_and_override():
    base = build_config(VIT, "base")
    short = build_config(VIT, "short")
    opt = build_config(VIT, "short_opt")
    assert short.embed_dim == base.embed_dim == 384 and short.img_size == [360, 720]
    assert short.limit_nsamples == 512 and base.limit_nsamples is None
    assert opt.limit_nsamples == 512 and opt.amp_mode == "fp16" and opt.enable_jit
    u = build_config(UNET, "short_opt")
    assert u.Nsamples == 4096 and u.data_size == 64 and u.full_scale


def test_command_line_overrides_are_typed():
    _, ov = parse_overrides(["--lr", "3e-3", "--img_size=[64,128]", "--enable_jit",
                             "--limit_nsamples", "None", "--num_data_workers", "4"])
    c = build_config(VIT, "base", ov)
    assert c.lr == 3e-3 and c.img_size == [64, 128] and c.enable_jit is True
    assert c.limit_nsamples is None and c.num_data_workers == 4


def test_reference_flags():
    _, ov = parse_overrides(["--enable_amp", "--enable_apex", "--num_epochs", "3"])
    c = build_config(UNET, "base", ov)
    assert c.amp_mode == "fp16" and c.enable_fused and c.num_epochs == 3
    # num_epochs from the command line replaces the config's num_iters, and the reverse
    c = build_config(VIT, "base", {"num_epochs": "2"})
    assert c.num_epochs == 2 and c.num_iters is None
    c = build_config(UNET, "base", {"num_iters": "7"})
    assert c.num_iters == 7 and c.num_epochs is None


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("ERA5_DATA_ROOT", "/somewhere/era5")
    assert build_config(VIT, "base").data_root == "/somewhere/era5"
    monkeypatch.delenv("ERA5_DATA_ROOT")
    assert build_config(VIT, "base").data_root == "/data/era5"


@pytest.mark.parametrize("name,overrides,fragment", [
    ("shortt", {}, "did you mean 'short'"),
    ("base", {"lrr": "1"}, "did you mean 'lr'"),
    ("base", {"embed_dimm": "8"}, "did you mean 'embed_dim'"),
    ("base", {"lr": "fast"}, "lr='fast' is not a number"),
    ("base", {"num_data_workers": "2.5"}, "is not an integer"),
    ("base", {"amp_mode": "fp8"}, "amp_mode='fp8' is not one of none, fp16, bf16"),
    ("base", {"patch_size": "7"}, "not divisible by patch_size=7"),
    ("base", {"num_heads": "5"}, "num_heads=5 does not divide embed_dim=384"),
    ("base", {"num_iters": "0"}, "num_iters=0 must be >= 1"),
    ("base", {"lr_schedule": "x"}, "use lr, end_lr, warmup_steps and lr_scaling"),
])
def test_errors_name_the_fix(name, overrides, fragment):
    with pytest.raises(ConfigError) as e:
        build_config(VIT, name, overrides)
    assert fragment in str(e.value)


def test_unet_checks():
    with pytest.raises(ConfigError, match="data_size=48 must be divisible by 2\\^6"):
        build_config(UNET, "base", {"data_size": "48"})
    with pytest.raises(ConfigError, match="did you mean 'embed_dim'|unknown setting 'embed_dim'"):
        build_config(UNET, "base", {"embed_dim": "8"})


def test_dump_reads_back(tmp_path):
    c = build_config(UNET, "quickstart", {"lr": "0.01"})
    p = tmp_path / "config.yaml"
    p.write_text(dump(c, {"world_size": 1}))
    again = build_config(str(p), "quickstart")
    assert again == c and yaml.safe_load(p.read_text())["quickstart"]["lr"] == 0.01


def test_cli_exit_code_and_single_message():
    r = subprocess.run([sys.executable, "train.py", "--config", "quikstart"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "did you mean 'quickstart'" in r.stderr
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--global_batch_size" in r.stdout
