"""What the run asks of torch and of the node before it starts: the oldest supported torch (and
the fallbacks that make it true), the device a GPU node's run lands on, and cuDNN autotuning."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import train
from conftest import ROOT
from distributed import grad_norm
from settings.parse import build_config
from settings.errors import ConfigError
from tasks import make_task
from engine.runtime import TORCH_FLOOR, check_torch_version, choose_device, configure_cuda

FLOOR = ".".join(map(str, TORCH_FLOOR))


def _model_with_grads(scale: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.GELU(), nn.Linear(5, 3))
    model(torch.randn(4, 7)).pow(2).sum().mul(scale).backward()
    model[0].bias.grad = None  # a parameter without a gradient is skipped, as in a frozen layer
    return model


@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e6])  # measure only, clipped, not clipped
def test_fallback_for_torch_before_2_6_gives_the_same_norm_and_clipped_gradients(
        monkeypatch, max_norm):
    """torch 2.5 has neither get_total_norm nor clip_grads_with_norm_: with both hidden, the
    foreach fallback gives the norm and the clipped gradients of the new API, bit for bit."""
    ref = _model_with_grads(3.0)
    want = grad_norm.clip_grad_norm(ref, max_norm)
    monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    monkeypatch.delattr(torch.nn.utils, "clip_grads_with_norm_")
    model = _model_with_grads(3.0)
    got = grad_norm.clip_grad_norm(model, max_norm)
    assert torch.equal(got, want) and got.dtype == torch.float32
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)
    if max_norm == 1e-3:  # the clipped gradient has the asked norm
        assert float(grad_norm.grad_norm(model)) == pytest.approx(1e-3, rel=1e-3)


def test_versions_below_the_floor_are_refused_and_prereleases_count_as_their_release():
    for ok in (FLOOR + ".0", FLOOR + ".0a0+e000cf0ad9", "2.6.0a0+ecf3bae", "2.13.0+cpu", "3.0"):
        check_torch_version(ok)
    with pytest.raises(ConfigError, match=rf"torch 2\.4\.1\+cu121 is older .*torch >= {FLOOR}"):
        check_torch_version("2.4.1+cu121")


def test_an_old_torch_stops_the_run_with_one_line_before_anything_is_written(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       {"expdir": str(tmp_path / "logs"), "data_root": str(tmp_path / "data")})
    with pytest.raises(SystemExit) as e:
        train.run(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: torch 2.4.1 is older"), err
    assert not os.path.exists(tmp_path / "logs") and not os.path.exists(tmp_path / "data")


def test_the_floor_is_the_one_requirements_txt_and_the_readme_state_with_the_image_it_uses():
    reqs = open(os.path.join(ROOT, "requirements.txt")).read()
    assert re.findall(r"^torch>=([\d.]+)$", reqs, re.M) == [FLOOR]
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = re.search(r"\*\*Supported versions\*\*: (.*?)\n\n", readme, re.S).group(1)
    assert f"torch {FLOOR} or newer (`torch>={FLOOR}`" in line
    image = re.search(r"^ARG BASE_IMAGE=(\S+)$",
                      open(os.path.join(ROOT, "docker", "Dockerfile")).read(), re.M).group(1)
    release = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", image).group(1)
    assert f"NGC {release} (`{image}`" in line


# ---------------------------------------------------------------- a GPU node, a CPU-only torch

def _vit(tmp_path, **kw):
    return build_config(f"{ROOT}/config/ViT.yaml", "quickstart", kw)


@pytest.mark.parametrize("var,value", [("CUDA_VISIBLE_DEVICES", "0"), ("SLURM_GPUS_ON_NODE", "4"),
                                       ("SLURM_JOB_GPUS", "0,1")])
def test_a_node_with_gpus_that_torch_cannot_use_is_refused_unless_the_cpu_is_asked_for(
        tmp_path, monkeypatch, var, value):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for v in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"this node has GPUs \({var}={value}.*--device cpu"):
        choose_device(_vit(tmp_path), 0)
    with pytest.raises(ConfigError, match=rf"device=cuda but no CUDA device is visible \({var}"):
        choose_device(_vit(tmp_path, device="cuda"), 0)
    assert choose_device(_vit(tmp_path, device="cpu"), 0) == torch.device("cpu")


def test_device_files_are_a_sign_and_hidden_gpus_are_none(tmp_path, monkeypatch):
    import engine.runtime as runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for v in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose
    monkeypatch.setattr(runtime.glob, "glob", lambda pattern: [])
    assert runtime.gpu_signs() == []
    assert choose_device(_vit(tmp_path), 0) == torch.device("cpu")
    monkeypatch.setattr(runtime.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1"])
    assert runtime.gpu_signs() == ["/dev/nvidia0 (and 1 more)"]
    with pytest.raises(ConfigError, match=r"this node has GPUs \(/dev/nvidia0 \(and 1 more\)\)"):
        choose_device(_vit(tmp_path), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_train_py_with_gpus_announced_stops_with_one_line_or_runs_on_the_cpu_when_asked(tmp_path):
    """As a user would meet it: a CPU-only torch, CUDA_VISIBLE_DEVICES=0 (as on a GPU node)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    args = [sys.executable, "train.py", "--expdir", str(tmp_path / "logs"), "--data_root",
            str(tmp_path / "data"), "--img_size", "[16,32]", "--patch_size", "4", "--embed_dim",
            "16", "--depth", "1", "--num_heads", "2", "--num_iters", "1"]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this node has GPUs "
                                                   "(CUDA_VISIBLE_DEVICES=0"), lines
    assert "--device cpu" in lines[0] and "CPU-only build" in lines[0]
    assert not os.path.exists(tmp_path / "logs") and not os.path.exists(tmp_path / "data")
    # on the CPU: the run's batches made in memory (a batch of 16 each way), none written first
    r = subprocess.run(args + ["--device", "cpu", "--data_loader_config", "synthetic",
                               "--limit_nsamples", "16", "--limit_nsamples_val", "16"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Device cpu" in r.stdout


# ---------------------------------------------------------------- cuDNN autotuning

@pytest.fixture
def cudnn_flags():
    b = torch.backends
    saved = (b.cudnn.benchmark, b.cudnn.deterministic, b.cuda.matmul.allow_tf32,
             b.cudnn.allow_tf32)
    yield
    (b.cudnn.benchmark, b.cudnn.deterministic, b.cuda.matmul.allow_tf32,
     b.cudnn.allow_tf32) = saved


def test_tf32_is_on_for_cuda_runs_as_in_the_tutorial_unless_turned_off(cudnn_flags, monkeypatch):
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    b = torch.backends

    def tf32(overrides, device="cuda"):
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = False, True  # torch's defaults
        configure_cuda(build_config(f"{ROOT}/config/ViT.yaml", "short", overrides),
                       torch.device(device))
        return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32

    assert tf32({}, "cpu") == (False, True)  # a CPU run leaves torch's flags alone
    assert tf32({}) == (True, True)  # torch's own default leaves matmuls in fp32
    assert tf32({"allow_tf32": "false"}) == (False, False)
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # the tutorial's experiment: fp32 throughout
    assert tf32({}) == (False, False)
    # the MFU then divides by the fp32 peak: the tasks read the switches configure_cuda set
    task = make_task(build_config(f"{ROOT}/config/ViT.yaml", "short", {}))
    assert task.fp32_in_tf32() is False


def test_cudnn_autotuning_is_on_for_cuda_runs_and_off_for_bitwise_reproducible_ones(
        tmp_path, cudnn_flags):
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, False
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "short", {})
    assert cfg.cudnn_benchmark is True  # the default, as in the tutorials
    configure_cuda(cfg, torch.device("cpu"))  # a CPU run leaves torch's flags alone
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, False)
    configure_cuda(cfg, torch.device("cuda", 0))
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, False)
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "short", {"cudnn_benchmark": "false"})
    configure_cuda(cfg, torch.device("cuda", 0))
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)
