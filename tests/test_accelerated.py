"""Compiled, mixed-precision and fused paths. torch.compile runs here on the CPU; the fp16 and
CUDA paths need a GPU and say so when skipped."""
import pytest
import torch

from conftest import ROOT
from settings.errors import ConfigError
from settings.parse import build_config
from engine.runtime import setup_runtime
from observe.memory import NullProbe
from train import Trainer

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = {"img_size": "[16,32]", "patch_size": "4", "embed_dim": "32", "depth": "1",
        "num_heads": "2", "global_batch_size": "4", "base_batch_size": "4",
        "synthesize_if_missing": "false", "log_every": "1", "checkpoint_every": "0"}


def losses_after(era5_root, tmp_path, steps=3, **kw):
    ov = dict(TINY, data_root=era5_root, expdir=str(tmp_path), num_iters=str(steps), **kw)
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    tr = Trainer(cfg, setup_runtime(cfg))
    tr.loaders.train_sampler.set_epoch(0)
    out = []
    for x, y in tr.loaders.train:
        out.append(tr.train_step(*tr.to_device(x, y), NullProbe())[0].item())
        if len(out) == steps:
            break
    return out, tr


@pytest.mark.compile
def test_compiled_model_trains_like_eager(era5_root, tmp_path):
    eager, _ = losses_after(era5_root, tmp_path / "a")
    compiled, tr = losses_after(era5_root, tmp_path / "b", enable_jit="true")
    assert "OptimizedModule" in type(tr.wrapped_model).__name__
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.compile
def test_a_compiled_validation_runs_one_graph_for_its_smaller_last_batch(era5_root, tmp_path):
    """11 validation samples in batches of 4, 4 and 3: the last one filled up to 4 runs the
    graph compiled for the others (no second compile for a batch of any size), and its metrics
    are those of its 3 samples."""
    from torch._dynamo.utils import counters
    _, eager = losses_after(era5_root, tmp_path / "a", steps=1)
    _, tr = losses_after(era5_root, tmp_path / "b", steps=1, enable_jit="true")
    graphs = counters["stats"]["unique_graphs"]
    got, want = tr.validate(), eager.validate()
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the eval graph, once
    assert got["count"] == want["count"] == 11
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert got["metrics"] == pytest.approx(want["metrics"], rel=1e-4, abs=1e-6)


@pytest.mark.compile
def test_compiled_blocks_train_like_eager_with_one_graph_for_all(era5_root, tmp_path):
    """compile_blocks: each transformer block compiled in place (the model is not wrapped, its
    parameters keep their names), one graph serving both blocks, the losses eager's."""
    from torch._dynamo.utils import counters
    eager, tr_eager = losses_after(era5_root, tmp_path / "a", depth="2")
    torch._dynamo.reset()
    counters.clear()
    blocks, tr = losses_after(era5_root, tmp_path / "b", depth="2", enable_jit="true",
                              compile_blocks="true")
    assert tr.wrapped_model is tr.model and type(tr.model).__name__ == "ViT"
    assert all(b._compiled_call_impl is not None for b in tr.model.blocks)
    assert tr.model.norm._compiled_call_impl is None  # the rest of the model runs eagerly
    assert counters["stats"]["unique_graphs"] == 1  # the second block reuses the first's
    assert list(tr.model.state_dict()) == list(tr_eager.model.state_dict())
    assert blocks == pytest.approx(eager, rel=1e-4, abs=1e-5)
    # with activation checkpointing the compiled blocks are recomputed in the backward
    checkpointed, _ = losses_after(era5_root, tmp_path / "c", depth="2", enable_jit="true",
                                   compile_blocks="true", activation_checkpointing="true")
    assert checkpointed == pytest.approx(eager, rel=1e-4, abs=1e-5)


def test_compile_blocks_without_enable_jit_is_refused(era5_root, tmp_path):
    with pytest.raises(ConfigError, match="compile_blocks=true .* add --enable_jit true"):
        losses_after(era5_root, tmp_path, compile_blocks="true")
    assert not (tmp_path / "quickstart").exists()


def test_bf16_autocast_on_cpu_runs_in_bf16(era5_root, tmp_path):
    fp32, _ = losses_after(era5_root, tmp_path / "a")
    bf16, tr = losses_after(era5_root, tmp_path / "b", amp_mode="bf16")
    with tr.autocast():
        assert tr.model.blocks[0].mlp.fc1(torch.randn(2, 32)).dtype == torch.bfloat16
    assert bf16 == pytest.approx(fp32, rel=5e-2) and bf16 != fp32


def test_fused_adam_matches_default(era5_root, tmp_path):
    plain, _ = losses_after(era5_root, tmp_path / "a")
    fused, tr = losses_after(era5_root, tmp_path / "b", enable_fused="true")
    assert tr.optimizer.defaults.get("fused") is True
    assert fused == pytest.approx(plain, rel=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_fp16_with_grad_scaler_on_gpu(era5_root, tmp_path):
    fp32, _ = losses_after(era5_root, tmp_path / "a", steps=5)
    fp16, tr = losses_after(era5_root, tmp_path / "b", steps=5, amp_mode="fp16",
                            enable_fused="true")
    assert tr.device.type == "cuda" and tr.scaler.is_enabled()
    assert tr.loaders.train.pin_memory
    assert fp16 == pytest.approx(fp32, rel=5e-2)


@pytest.mark.gpu
@pytest.mark.compile
@needs_gpu
def test_compile_bf16_on_gpu(era5_root, tmp_path):
    eager, _ = losses_after(era5_root, tmp_path / "a", amp_mode="bf16")
    compiled, _ = losses_after(era5_root, tmp_path / "b", amp_mode="bf16", enable_jit="true")
    assert compiled == pytest.approx(eager, rel=5e-2)
