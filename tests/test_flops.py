"""Analytic model FLOPs against torch's FLOP counter, the peak table, and the epoch's log line."""
import os
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import ROOT
from test_training import TINY_VIT, run_dir, tb_scalars, train
from settings.parse import build_config
from observe import run_log
from observe.run_log import PEAK_TFLOPS, peak_tflops
from tasks import make_task
from observe.logging_utils import Nothing

VIT_SIZES = [  # two shapes, so that a term wrong in N, E, depth, heads or the MLP shows
    {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2},
    {"img_size": [24, 48], "patch_size": 2, "embed_dim": 48, "depth": 3, "num_heads": 4,
     "mlp_ratio": 2.0, "n_in_channels": 6, "n_out_channels": 3},
]
UNET_SIZES = [
    {"base_width": 4, "max_width": 16, "full_scale": False, "data_size": 32},
    {"base_width": 3, "max_width": 8, "full_scale": True, "data_size": 64},  # widths capped
]


def counted_flops(cfg) -> int:
    """FLOPs torch counts for the forward and backward of one sample of the real model."""
    torch.manual_seed(0)
    model = make_task(cfg).build_model()
    if hasattr(cfg, "img_size"):
        x = torch.randn(1, cfg.n_in_channels, *cfg.img_size)
    else:
        x = torch.randn(1, cfg.n_in_channels, *[cfg.data_size] * 3)
    # The CPU's fused attention kernel is not in the counter's table; the math form (bmm) is.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).square().mean().backward()
    return counter.get_total_flops()


def test_counter_sees_attention_in_the_math_form():
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    heads, n, hd = 2, 16, 8
    assert counter.get_total_flops() == 3 * 2 * (2 * heads * n * n * hd)  # (q k^T, P V) x 3


@pytest.mark.parametrize("size", VIT_SIZES)
def test_vit_flops_match_the_counter(size):
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "base", size)
    assert make_task(cfg).flops_per_sample() == pytest.approx(counted_flops(cfg), rel=0.02)


@pytest.mark.parametrize("size", UNET_SIZES)
def test_unet_flops_match_the_counter(size):
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "base", size)
    assert make_task(cfg).flops_per_sample() == pytest.approx(counted_flops(cfg), rel=0.02)


def test_flops_grow_with_the_model_as_expected():
    base = build_config(f"{ROOT}/config/ViT.yaml", "base", VIT_SIZES[0])
    deeper = build_config(f"{ROOT}/config/ViT.yaml", "base", dict(VIT_SIZES[0], depth=4))
    one_block = (make_task(deeper).flops_per_sample() - make_task(base).flops_per_sample()) / 2
    n, e = 4 * 8, 32
    assert one_block == 3 * (24 * n * e * e + 4 * n * n * e)  # qkv+proj+MLP, scores+PV
    # The tutorial's models: 1.44e12 (ViT) and 8.05e10 (U-Net) training FLOPs per sample.
    vit = make_task(build_config(f"{ROOT}/config/ViT.yaml", "base")).flops_per_sample()
    unet = make_task(build_config(f"{ROOT}/config/UNet.yaml", "base")).flops_per_sample()
    assert vit == pytest.approx(1.443e12, rel=1e-3) and unet == pytest.approx(8.046e10, rel=1e-3)


def test_peak_lookup_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H200", "fp16") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "none", allow_tf32=True) == 156.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "none", allow_tf32=False) == 19.5
    assert peak_tflops("NVIDIA H100 PCIe", "none", allow_tf32=False) == PEAK_TFLOPS["H100"]["fp32"]
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_tflops(torch.device("cpu"), "bf16") is None


def test_epoch_logs_tflops(tmp_path, era5_root):
    exp = str(tmp_path / "logs")
    train(TINY_VIT + ["--data_root", era5_root, "--expdir", exp, "--num_epochs", "1"])
    d = run_dir(exp)
    lines = [ln for ln in open(os.path.join(d, "out.log")) if "TFLOP/s" in ln]
    assert len(lines) == 1 and "MFU" not in lines[0], lines  # no known peak on a CPU
    acc = tb_scalars(os.path.join(d, "tensorboard"))
    tags = set(acc.Tags()["scalars"])
    assert "Performance/TFLOPs per sec" in tags and "Performance/MFU" not in tags, tags
    sps = acc.Scalars("Avg samples per sec")[0].value
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 1,
                        "num_heads": 2})
    expected = make_task(cfg).flops_per_sample() * sps / 1e12  # one device
    assert acc.Scalars("Performance/TFLOPs per sec")[0].value == pytest.approx(expected, rel=1e-4)


class RecordingBoard(Nothing):
    """Keeps the last value of each scalar tag."""

    def __init__(self):
        self.scalars = {}

    def scalar(self, tag, value, step):
        self.scalars[tag] = value


def h100_trainer(tmp_path, era5_root, monkeypatch, **settings):
    """A tiny bf16 ViT Trainer on a CPU whose peak lookup is given an H100's name (the GPU branch
    of the epoch's log); returns it and its config."""
    import train
    from engine.runtime import setup_runtime

    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_iters="2", amp_mode="bf16", **settings)
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    trainer = train.Trainer(cfg, setup_runtime(cfg))
    monkeypatch.setattr(run_log, "peak_tflops",
                        lambda device, amp, tf32: peak_tflops("NVIDIA H100 80GB HBM3", amp, tf32))
    return trainer, cfg


def test_epoch_logs_mfu_when_the_peak_is_known(tmp_path, era5_root, monkeypatch):
    """The MFU branch of the epoch's log, on a CPU: the lookup is given an H100's name."""
    import train

    trainer, cfg = h100_trainer(tmp_path, era5_root, monkeypatch)
    trainer.run_log.board = RecordingBoard()
    stats = train.EpochStats(avg_loss=1.0, elapsed_s=1.0, steps=10, samples_per_s=8.0, data_wait=0.25)
    trainer.run_log.epoch(stats, trainer.validate(), 0.1, 0, trainer.iteration)
    tflops = make_task(cfg).flops_per_sample() * 2.0 * 4 / 1e12  # 2 steps/s of 4 samples on 1 device
    got = trainer.run_log.board.scalars
    assert got["Performance/TFLOPs per sec"] == pytest.approx(tflops)
    assert got["Performance/MFU"] == pytest.approx(tflops / 989.0)
    log = open(os.path.join(trainer.run_dir, "out.log")).read()
    assert f"MFU {100 * tflops / 989:.1f}% of 989 TFLOP/s peak" in log, log[-2000:]


@pytest.fixture
def tf32_switches():
    """torch's TF32 switches, put back after the test (they are process-wide)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("yaml,tiny,peak", [
    ("UNet.yaml", {"base_width": 4, "max_width": 8, "full_scale": False, "data_size": 32,
                   "Nsamples": 8, "Nsamples_val": 4, "synthetic_size": [32, 32]}, 494.0),
    ("ViT.yaml", {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 1,
                  "num_heads": 2}, 67.0)])
def test_fp32_mfu_uses_the_peak_of_the_switch_that_governs_the_models_flops(
        tmp_path, monkeypatch, tf32_switches, yaml, tiny, peak):
    """amp_mode none on an H100, with torch's defaults (cuDNN may use TF32, cuBLAS may not): the
    U-Net's convolutions count against the TF32 peak, the ViT's matmuls against the fp32 one."""
    import train
    from engine.runtime import setup_runtime

    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    cfg = build_config(f"{ROOT}/config/{yaml}", "quickstart",
                       dict(tiny, expdir=str(tmp_path), data_root=str(tmp_path / "data"),
                            num_iters=1, amp_mode="none"))
    trainer = train.Trainer(cfg, setup_runtime(cfg))
    monkeypatch.setattr(run_log, "peak_tflops",
                        lambda device, amp, tf32: peak_tflops("NVIDIA H100 80GB HBM3", amp, tf32))
    trainer.run_log.board = RecordingBoard()
    trainer.run_log.epoch(train.EpochStats(1.0, 1.0, 10, 16.0, data_wait=0.0), trainer.validate(),
                          0.1, 0, trainer.iteration)
    trainer.loaders.close()
    tflops = trainer.run_log.board.scalars["Performance/TFLOPs per sec"]
    assert trainer.run_log.board.scalars["Performance/MFU"] == pytest.approx(tflops / peak)
    # Flipping the other switch changes nothing; flipping the model's own does.
    other, own = ((torch.backends.cuda.matmul, torch.backends.cudnn) if yaml == "UNet.yaml"
                  else (torch.backends.cudnn, torch.backends.cuda.matmul))
    other.allow_tf32 = not other.allow_tf32
    assert make_task(cfg).fp32_in_tf32() == (peak == 494.0)
    own.allow_tf32 = not own.allow_tf32
    assert make_task(cfg).fp32_in_tf32() == (peak != 494.0)


def test_fp32_peak_needs_to_know_whether_tf32_is_on():
    with pytest.raises(ValueError, match="TF32"):
        peak_tflops("NVIDIA H100 80GB HBM3", "none")


def _tp2_rank(overrides):
    """A tensor-parallel run of the engine; rank 0 returns its TensorBoard scalars."""
    import torch.distributed as dist

    import train
    from engine.runtime import setup_runtime

    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", overrides)
    trainer = train.Trainer(cfg, setup_runtime(cfg))
    board = trainer.run_log.board = RecordingBoard()
    trainer.fit()
    return board.scalars if dist.get_rank() == 0 else None


def test_tensor_parallel_ranks_share_each_sample(tmp_path, era5_root):
    """tp=2: one replica of two ranks; each device does half of each sample's FLOPs."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from distributed_harness import run_ranks

    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_iters="4", tensor_parallel="2",
              device="cpu")
    scalars = run_ranks(_tp2_rank, 2, ov, timeout=120)[0]
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    sps = scalars["Avg samples per sec"]  # the replica's (the job's) samples/s
    assert scalars["Performance/TFLOPs per sec"] == pytest.approx(make_task(cfg).flops_per_sample() * sps / 2 / 1e12)


def test_a_rollout_epochs_flops_count_each_of_its_steps(tmp_path, era5_root, monkeypatch):
    """Rollout training passes each sample through the model once per step: the epoch's GFLOP per
    sample, TFLOP/s and MFU count every step of that epoch's rollout (the schedule's)."""
    import train

    trainer, cfg = h100_trainer(tmp_path, era5_root, monkeypatch, rollout_schedule="0:1,1:3")
    one = make_task(cfg).flops_per_sample()
    assert make_task(cfg).flops_per_sample(0) == one and make_task(cfg).flops_per_sample(1) == 3 * one
    trainer.run_log.board = RecordingBoard()
    stats = train.EpochStats(avg_loss=1.0, elapsed_s=1.0, steps=10, samples_per_s=8.0)
    trainer.run_log.epoch(stats, trainer.validate(), 0.1, 1, trainer.iteration)
    tflops = 3 * one * 8.0 / 1e12
    assert trainer.run_log.board.scalars["Performance/TFLOPs per sec"] == pytest.approx(tflops)
    assert trainer.run_log.board.scalars["Performance/MFU"] == pytest.approx(tflops / 989.0)
    log = open(os.path.join(trainer.run_dir, "out.log")).read()
    assert f"({3 * one / 1e9:.4g} GFLOP per sample), MFU" in log
