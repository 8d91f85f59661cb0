import subprocess
import sys

import pytest
import yaml

from settings.cli import settings_help
from settings.config import CONFIG_CLASSES, to_dict
from settings.parse import build_config, dump, parse_overrides
from settings.errors import ConfigError

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


def test_list_settings_are_written_either_way():
    """``--img_size 64 128`` (argparse's way, as datapipe.synthetic writes it), '[64,128]' and
    64,128 are the same; several values for a setting that takes one are refused."""
    for argv in (["--img_size", "64", "128"], ["--img_size", "[64,128]"], ["--img_size=64,128"],
                 ["--adam_betas", "0.8", "0.9", "--img_size", "64", "128", "--enable_jit"]):
        c = build_config(VIT, "base", parse_overrides(argv)[1])
        assert c.img_size == [64, 128], argv
    assert c.adam_betas == [0.8, 0.9] and c.enable_jit is True
    with pytest.raises(ConfigError, match=r"--lr takes one value, not 2 \(0.1 0.2\)"):
        build_config(VIT, "base", parse_overrides(["--lr", "0.1", "0.2"])[1])
    with pytest.raises(ConfigError, match="img_size=\\[64, 128, 3\\] must have 2 entries"):
        build_config(VIT, "base", parse_overrides(["--img_size", "64", "128", "3"])[1])
    with pytest.raises(ConfigError, match="unexpected argument 'b': --config takes one value"):
        parse_overrides(["--config", "a", "b"])


def test_a_value_that_looks_like_a_one_dash_flag_is_named():
    """The tutorial's own typo: ``--num_epochs 10 -enable_benchy``."""
    with pytest.raises(ConfigError, match=r"--num_epochs takes one value, not 2 \(10 "
                       r"-enable_benchy\): '-enable_benchy' has one dash: write --enable_benchy"):
        build_config(VIT, "base", parse_overrides(["--num_epochs", "10", "-enable_benchy"])[1])
    with pytest.raises(ConfigError, match="quote a value"):  # a negative number is a value
        build_config(VIT, "base", parse_overrides(["--lr", "0.1", "-2"])[1])


def test_a_setting_and_its_tutorial_name_given_together_must_agree():
    c = build_config(VIT, "mp", {"row_parallel_size": "2", "tensor_parallel": "2"})
    assert c.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"--row_parallel_size is --tensor_parallel, and both are "
                       r"given \(row_parallel_size=2, tensor_parallel=1; command line\): keep one"):
        build_config(VIT, "mp", {"row_parallel_size": "2", "tensor_parallel": "1"})


def test_the_tutorials_loader_names_are_this_projects():
    assert build_config(VIT, "short", {"data_loader_config": "pytorch"}).data_loader_config \
        == "lowmem"
    assert build_config(VIT, "short", {"data_loader_config": "dali"}).data_loader_config \
        == "dali-lowmem"


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
    ("base", {"patch_size": "7"}, "not divisible by patch_size=7: change img_size to "
     "multiples of 7, e.g. --img_size 357 721, or --patch_size 6"),
    ("base", {"img_size": "[33, 64]"}, "change img_size to multiples of 8, e.g. --img_size 32 64"),
    ("base", {"batch_size": "0"}, "did you mean 'global_batch_size' or 'local_batch_size'?"),
    ("base", {"device": "gpu"}, "device='gpu' is not one of auto, cpu, cuda: did you mean 'cuda'?"),
    ("base", {"amp_mode": "fp32"}, "did you mean 'none'?"),
    ("base", {"num_heads": "5"}, "num_heads=5 does not divide embed_dim=384"),
    ("base", {"num_iters": "0"}, "num_iters=0 must be >= 1"),
    ("base", {"lr_schedule": "x"}, "use lr, end_lr, warmup_steps and lr_scaling"),
    ("base", {"adam_betas": "[0.9, 1.0]"}, "adam_betas[1]=1.0 must be < 1.0"),
    ("base", {"adam_betas": "[-0.1, 0.9]"}, "adam_betas[0]=-0.1 must be >= 0.0"),
    ("base", {"adam_betas": "[0.9]"}, "adam_betas=[0.9] must have 2 entries, e.g. adam_betas=[0.9"),
    ("base", {"adam_betas": "[0.9, fast]"}, "adam_betas[1]='fast' is not a number"),
    ("base", {"layer_norm_eps": "0"}, "layer_norm_eps=0.0 must be > 0.0"),
    ("base", {"head_bias": "maybe"}, "head_bias='maybe' is not a boolean"),
    ("base", {"img_size": "[16, 3.5]"}, "img_size[1]=3.5 is not an integer"),
    ("base", {"data_loader_config": "inmen"}, "did you mean 'inmem'"),
    ("base", {"data_loader_config": "DALI"}, "did you mean 'dali'?"),  # case aside; an alias
    ("base", {"data_loader_config": "gpu"}, "dali-inmem, device: choose one of these"),
    ("base", {"resume": "maybe"}, "resume='maybe' is not one of false, true, auto"),  # as typed
    ("base", {"name": "other"}, "'name' is not a setting (command line)"),
    ("base", {"yaml_path": "x.yaml"}, "chosen with --config and --yaml_config"),
    ("base", {"lr": "nan"}, "lr='nan' is not a finite number"),
    ("base", {"dropout": "nan"}, "dropout='nan' is not a finite number"),
    ("base", {"max_grad_norm": "inf"}, "max_grad_norm='inf' is not a finite number"),
    ("base", {"seed": "-1"}, "seed=-1 must be >= 0"),
    ("base", {"loss_variable_weights": "[t2=1]"}, "'t2=1' is not NAME=WEIGHT with a weight >= 0 and "
     "NAME one of u10m, v10m, t2m"),
    ("base", {"loss_variable_weights": "[t2m=-1]"}, "'t2m=-1' is not NAME=WEIGHT"),
    ("base", {"loss_variable_weights": "[t2m]"}, "'t2m' is not NAME=WEIGHT"),
    ("base", {"seed": str(2**64)}, f"seed={2**64} must be <= {2**32 - 1}"),
    ("base", {"expdir": ""}, "expdir is empty: give the directory"),
    ("base", {"run_num": ""}, "run_num='' is not the name of a run"),
    ("base", {"run_num": "../../elsewhere"}, "run_num='../../elsewhere' is not the name of a run"),
    ("base", {"parallel_order": "tp-xx-dp"}, "did you mean 'tp-cp-dp'"),
    ("base", {"compile_cache_dir": f"{ROOT}/README.md"}, "README.md is a file, not a directory"),
])
def test_errors_name_the_fix(name, overrides, fragment):
    with pytest.raises(ConfigError) as e:
        build_config(VIT, name, overrides)
    assert fragment in str(e.value)


def test_a_config_of_the_other_yaml_file_is_named_with_the_flag_that_reads_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as e:
        build_config(VIT, "bs512_test")  # a U-Net config, asked of the ViT's file
    assert "it is in config/UNet.yaml: add --yaml_config config/UNet.yaml" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config(VIT, "no_such_config_anywhere")
    assert "it is in" not in str(e.value) and "choose one of" in str(e.value)


def test_unet_checks():
    with pytest.raises(ConfigError, match="data_size=48 must be divisible by 2\\^6"):
        build_config(UNET, "base", {"data_size": "48"})
    with pytest.raises(ConfigError, match="leaky_relu_slope=-0.1 must be >= 0.0"):
        build_config(UNET, "base", {"leaky_relu_slope": "-0.1"})
    with pytest.raises(ConfigError, match="did you mean 'embed_dim'|unknown setting 'embed_dim'"):
        build_config(UNET, "base", {"embed_dim": "8"})


def test_dump_reads_back(tmp_path):
    c = build_config(UNET, "quickstart", {"lr": "0.01", "adam_betas": "[0.8,0.9]"})
    assert (c.name, c.yaml_path) == ("quickstart", UNET)
    p = tmp_path / "config.yaml"
    p.write_text(dump(c, {"world_size": 1}))
    again = build_config(str(p), "quickstart")
    assert again == c and (again.name, again.yaml_path) == ("quickstart", str(p))
    settings = yaml.safe_load(p.read_text())["quickstart"]
    assert settings["lr"] == 0.01 and settings["adam_betas"] == [0.8, 0.9]
    # name and file are the mapping's key and a comment, not settings; the checkpoint keeps both
    assert "name" not in settings and "yaml_path" not in settings
    assert f"# read from: {UNET}" in p.read_text()
    assert to_dict(c)["name"] == "quickstart" and to_dict(c)["yaml_path"] == UNET
    assert build_config(UNET, "quickstart", {"lr": "0.02"}) != c


def test_types_and_choices_come_from_the_annotations():
    c = build_config(VIT, "base", {"img_size": "32,64", "adam_betas": "[0, 0.5]",
                                   "amp_mode": "bf16"})
    assert c.img_size == [32, 64] and c.adam_betas == [0.0, 0.5] and c.amp_mode == "bf16"
    assert all(type(v) is float for v in c.adam_betas)
    text = settings_help(build_config(VIT, "base")) + settings_help(build_config(UNET, "base"))
    assert "--adam_betas" in text and "--leaky_relu_slope" in text and "--head_bias" in text
    assert "--name " not in text and "--yaml_path" not in text
    for cls in CONFIG_CLASSES.values():
        assert cls().name == "" and "name" in to_dict(cls())


def test_cli_exit_code_and_single_message():
    r = subprocess.run([sys.executable, "train.py", "--config", "quikstart"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "did you mean 'quickstart'" in r.stderr
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--global_batch_size" in r.stdout


def test_an_error_line_is_one_write_so_ranks_sharing_stderr_never_join_lines(monkeypatch):
    """torchrun runs its ranks unbuffered on one stream: a line written in two parts (print's
    text, then its newline) can have another rank's line land between them."""
    import sys

    from settings.errors import print_error, refuse

    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    print_error("the data is gone: restore it", "[rank 3] ")
    with pytest.raises(SystemExit) as e:
        refuse("--lr x: give a number")
    assert e.value.code == 2
    assert writes == ["[rank 3] error: the data is gone: restore it\n",
                      "error: --lr x: give a number\n"]
