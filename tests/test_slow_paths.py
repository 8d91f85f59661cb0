"""The start-up line naming a known slow path of torch/cuDNN (``engine/slow_paths.py``), with the
versions faked on the CPU:

- each combination torch's source sends past cuDNN warns, naming the versions seen and the ones
  to install; its neighbours (2.8, 2.9.1 with cuDNN >= 9.15, 2.10, 2.11, pre-releases) do not;
- only half-precision 3-D convolutions in the default layout on a GPU: fp32, channels-last, a
  CPU, a model with only 2-D convolutions (the ViT) or 1x1x1 ones say nothing;
- the trainer calls the check at start-up with the built model, its device, amp mode and layout.
"""
import logging
import os

import pytest
import torch
from torch import nn

import train as train_script
from conftest import ROOT, write_cosmo_pair
from engine import parallelism, slow_paths
from engine.runtime import setup_runtime
from engine.slow_paths import conv3d_slow_path, convolves_in_3d, cudnn_int, warn_slow_paths
from settings.parse import build_config
from tasks import make_task

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
CL = torch.channels_last_3d
TINY_UNET = dict(base_width="4", max_width="16", data_size="32", Nsamples="8", Nsamples_val="4",
                 global_batch_size="4", base_batch_size="4", synthesize_if_missing="false",
                 num_data_workers="0")


def unet_cfg(tmp_path, **kw):
    return build_config(os.path.join(ROOT, "config", "UNet.yaml"), "quickstart",
                        dict(TINY_UNET, expdir=str(tmp_path / "exp"), **kw))


@pytest.fixture
def unet(tmp_path):
    return make_task(unet_cfg(tmp_path)).build_model()


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    cfg = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                       {"expdir": str(tmp_path_factory.mktemp("vit"))})
    return make_task(cfg).build_model()


@pytest.fixture
def faked(monkeypatch):
    """The versions the check reads, set by the test: ``faked(torch, loaded, built)``."""
    def fake(version, loaded, built=None):
        monkeypatch.setattr(slow_paths, "stack_versions", lambda: (version, loaded, built))
    return fake


# ----------------------------------------------------------------- the combinations themselves

@pytest.mark.parametrize("version, loaded, built, amp, names", [
    # 2.9.0 decides by the cuDNN it was built with (9.8.0 in PyPI's cu128 wheel), whatever loads
    ("2.9.0+cu128", 91002, 90800, "bf16",
     ["torch 2.9.0+cu128 (built with cuDNN 9.8.0)", "install torch 2.9.1 with cuDNN >= 9.15",
      "'nvidia-cudnn-cu12>=9.15'", "torch >= 2.10"]),
    ("2.9.0+cu130", 91500, 91300, "fp16", ["built with cuDNN 9.13.0", "'nvidia-cudnn-cu13>=9.15'"]),
    ("2.9.0", 91900, 90800, "bf16", ["torch 2.9.0 (built with cuDNN 9.8.0)"]),
    # 2.9.1 decides by the cuDNN it loaded: 9.8.0 to 9.14.x
    ("2.9.1+cu128", 91002, 90800, "bf16",
     ["torch 2.9.1+cu128 with cuDNN 9.10.2", "install cuDNN >= 9.15",
      "pip install 'nvidia-cudnn-cu12>=9.15'", "torch >= 2.10"]),
    ("2.9.1+cu128", 90800, 90800, "fp16", ["with cuDNN 9.8.0", "fp16 3-D convolutions"]),
    ("2.9.1+cu130", 91499, 91300, "bf16", ["with cuDNN 9.14.99", "nvidia-cudnn-cu13"]),
])
def test_each_confirmed_combination_warns_with_the_versions_and_the_fix(version, loaded, built,
                                                                        amp, names):
    line = conv3d_slow_path(version, loaded, amp, "cuda", cudnn_built=built)
    assert line.startswith("Slow path: ") and "\n" not in line
    assert f"runs {amp} 3-D convolutions in the default memory layout without cuDNN" in line
    assert "4x slower" in line and "17x the memory" in line
    assert "--memory_format channels_last" in line
    for name in names:
        assert name in line


@pytest.mark.parametrize("version, loaded, built", [
    ("2.9.1+cu128", 91500, 90800),  # cuDNN 9.15: cuDNN again
    ("2.9.1+cu128", 91900, 90800),
    ("2.9.1+cu128", 90701, 90800),  # below 9.8
    ("2.9.0+cu128", 91002, 90701),  # 2.9.0 built with cuDNN < 9.8
    ("2.9.0+cu128", 91002, None),  # the build's cuDNN unknown: not confirmed, not named
    ("2.8.0+cu128", 91002, 91002),
    ("2.10.0+cu128", 91002, 91002),
    ("2.11.0+cu130", 91300, 91300),
    ("2.13.0+cu130", 91300, 91300),
    ("2.9.0a0+git1234567", 91002, 90800),  # pre-releases and source builds: not known here
    ("2.9.1rc1", 91002, 90800),
    ("2.9.1+cu128", None, None),  # no cuDNN
])
def test_the_good_neighbours_say_nothing(version, loaded, built):
    for amp in ("bf16", "fp16"):
        assert conv3d_slow_path(version, loaded, amp, "cuda", cudnn_built=built) is None


@pytest.mark.parametrize("version, loaded, built", [("2.9.0+cu128", 91002, 90800),
                                                    ("2.9.1+cu128", 91002, 90800)])
def test_only_half_precision_in_the_default_layout_on_a_gpu(version, loaded, built):
    assert conv3d_slow_path(version, loaded, "bf16", "cuda", cudnn_built=built)
    assert conv3d_slow_path(version, loaded, "bf16", "cuda", cudnn_built=built,
                            memory_format=torch.contiguous_format)
    # float32 inputs keep cuDNN (the source checks for bfloat16 or float16 inputs)
    assert conv3d_slow_path(version, loaded, "none", "cuda", cudnn_built=built) is None
    # channels-last 3-D input and weights keep cuDNN (the source checks for the default layout)
    assert conv3d_slow_path(version, loaded, "bf16", "cuda", cudnn_built=built,
                            memory_format=CL) is None
    for device_type in ("cpu", "mps"):
        assert conv3d_slow_path(version, loaded, "bf16", device_type, cudnn_built=built) is None


def test_cudnn_versions_as_torch_reports_them():
    assert cudnn_int((9, 10, 2)) == 91002 and cudnn_int((9, 8, 0)) == 90800
    assert cudnn_int((8, 9, 7)) == 8907


# --------------------------------------------------------------------------------- the models

def test_only_models_with_3d_kernels_larger_than_one(unet, vit):
    assert convolves_in_3d(unet) and not convolves_in_3d(vit)
    assert any(isinstance(m, nn.Conv2d) for m in vit.modules())  # its patch embedding
    assert convolves_in_3d(nn.Sequential(nn.ConvTranspose3d(2, 2, 2)))
    assert not convolves_in_3d(nn.Sequential(nn.Conv3d(2, 2, 1), nn.Linear(2, 2)))
    assert convolves_in_3d(nn.Conv3d(2, 2, (1, 1, 3)))


def test_the_unet_on_a_bad_combination_warns_once(unet, faked, caplog):
    faked("2.9.1+cu128", 91002, 90800)
    with caplog.at_level(logging.WARNING, logger="engine.slow_paths"):
        line = warn_slow_paths(unet, CUDA, "bf16", torch.contiguous_format)
    assert [r.getMessage() for r in caplog.records] == [line]
    assert caplog.records[0].levelno == logging.WARNING
    assert "torch 2.9.1+cu128 with cuDNN 9.10.2" in line


def test_nothing_said_for_the_vit_a_cpu_fp32_channels_last_or_another_rank(unet, vit, faked,
                                                                            caplog):
    faked("2.9.0+cu128", 91002, 90800)
    with caplog.at_level(logging.WARNING, logger="engine.slow_paths"):
        assert warn_slow_paths(vit, CUDA, "bf16", torch.contiguous_format) is None
        assert warn_slow_paths(unet, torch.device("cpu"), "bf16", torch.contiguous_format) is None
        assert warn_slow_paths(unet, CUDA, "none", torch.contiguous_format) is None
        assert warn_slow_paths(unet, CUDA, "bf16", CL) is None
        assert warn_slow_paths(unet, CUDA, "bf16", torch.contiguous_format, is_main=False) is None
    assert caplog.records == []


def test_a_cpu_reads_no_versions(unet, monkeypatch):
    def unread():
        raise AssertionError("the versions were read on a CPU")
    monkeypatch.setattr(slow_paths, "stack_versions", unread)
    assert warn_slow_paths(unet, torch.device("cpu"), "bf16", torch.contiguous_format) is None


def test_the_versions_read_here():
    version, loaded, built = slow_paths.stack_versions()
    assert version == torch.__version__
    if not torch.backends.cudnn.is_available():  # a CPU build of torch: no cuDNN at all
        assert loaded is None and built is None


# ------------------------------------------------------------------------- the start-up hook

def test_the_trainer_checks_its_model_at_start_up(tmp_path, monkeypatch, faked, caplog):
    root = write_cosmo_pair(tmp_path / "cosmo", side=32)
    calls = []

    def noted(model, device, amp_mode, memory_format, is_main):
        calls.append((model, device, amp_mode, memory_format, is_main))
        return warn_slow_paths(model, device, amp_mode, memory_format, is_main)
    monkeypatch.setattr(parallelism, "warn_slow_paths", noted)  # (apply_parallelism calls it)
    faked("2.9.1+cu128", 91002, 90800)
    cfg = unet_cfg(tmp_path, data_root=root, amp_mode="bf16")
    with caplog.at_level(logging.WARNING, logger="engine.slow_paths"):
        trainer = train_script.Trainer(cfg, setup_runtime(cfg))
    [(model, device, amp_mode, memory_format, is_main)] = calls
    assert convolves_in_3d(model) and model is trainer.model
    assert (device, amp_mode, memory_format, is_main) == (torch.device("cpu"), "bf16",
                                                          torch.contiguous_format, True)
    assert caplog.records == []  # the CPU says nothing; the same call on a GPU would:
    assert warn_slow_paths(model, CUDA, amp_mode, memory_format, is_main).startswith("Slow path")
