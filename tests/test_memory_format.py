"""``memory_format`` (U-Net): the weights, batches and loss in ``torch.channels_last_3d``.

- which layout each choice gives where (``CosmoTask.memory_format``), and that the ViT has no
  such setting;
- a channels-last run takes the same steps as one in the default layout: the losses and the
  weights after a few steps agree to float32 rounding (bf16 autocast: to bf16's), and its
  parameters, optimizer moments and batches really are channels-last;
- the device loader cuts channels-last crops (its GPU gather and its CPU copies) with the same
  values; the synthetic loader keeps its batch so; ``Trainer.to_device`` converts the others;
- checkpoints hold the default layout, and a run resumes across formats;
- the CUDA-graph step's static input buffers take the batches' layout.
"""
import dataclasses
import os
import types

import pytest
import torch

import train as train_script
from conftest import ROOT, write_cosmo_pair
from datapipe.data_loader import build_loaders
from engine import checkpoint
from engine.cuda_graph import StepGraph
from engine.runtime import setup_runtime
from settings.errors import ConfigError
from settings.parse import build_config
from tasks import cosmo, make_task
import test_cuda_graph
from test_cuda_graph import ReplayOnCPU
from train import Trainer
from train_graph import GraphTrainer

CPU = torch.device("cpu")
CL = torch.channels_last_3d
UNET_YAML = os.path.join(ROOT, "config", "UNet.yaml")
TINY_UNET = dict(base_width="4", max_width="16", data_size="32", Nsamples="16", Nsamples_val="4",
                 global_batch_size="4", base_batch_size="4", lr="1e-3", warmup_steps="0",
                 synthesize_if_missing="false", num_data_workers="0", log_every="1",
                 enable_fused="true")


def channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=CL) and not t.is_contiguous()


@pytest.fixture(scope="module")
def cosmo32(tmp_path_factory):
    return write_cosmo_pair(tmp_path_factory.mktemp("mf") / "cosmo", side=32)


def unet_cfg(root, expdir, **kw):
    over = dict(TINY_UNET, data_root=root, expdir=str(expdir),
                **{k: str(v) for k, v in kw.items()})
    return build_config(UNET_YAML, "quickstart", over)


class Noting(test_cuda_graph.Noting):
    """Notes, beside each step's loss, the layout of the batches the step was given and whether
    the gradients the optimizer applied were channels-last (the 5-D ones)."""

    def __init__(self, cfg, rt, **kw):
        super().__init__(cfg, rt, **kw)
        self.batch_layouts, self.grad_layouts = set(), set()
        self.optimizer.register_step_pre_hook(self._note)

    def _note(self, optimizer, args, kwargs):
        self.grad_layouts.add(tuple(channels_last(p.grad) for p in self.model.parameters()
                                    if p.dim() == 5))

    def train_step(self, x, y, *args):
        self.batch_layouts.add((channels_last(x), channels_last(y)))
        return super().train_step(x, y, *args)


NotingTrainer = type("NotingTrainer", (Noting, Trainer), {})
NotingGraphTrainer = type("NotingGraphTrainer", (Noting, GraphTrainer), {})


def run(root, expdir, steps=3, cls=NotingTrainer, **kw):
    cfg = unet_cfg(root, expdir, num_iters=steps, **kw)
    extra = {"ops": ReplayOnCPU()} if cls is NotingGraphTrainer else {}
    tr = cls(cfg, setup_runtime(cfg), **extra)
    tr.fit()
    return tr


def assert_same_weights(a, b, rtol, atol):
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------- the choice


@pytest.mark.parametrize("choice,device,jit,amp,expect", [
    ("auto", "cpu", False, "bf16", torch.contiguous_format),
    ("auto", "cuda", False, "bf16", CL),
    ("auto", "cuda", False, "fp16", CL),
    ("auto", "cuda", False, "none", torch.contiguous_format),  # fp32: gain unmeasured
    ("auto", "cuda", True, "bf16", torch.contiguous_format),  # see CHANNELS_LAST_COMPILE_OPTIONS
    ("channels_last", "cpu", False, "none", CL),
    ("channels_last", "cuda", False, "none", CL),
    ("contiguous", "cuda", False, "bf16", torch.contiguous_format),
])
def test_the_layout_each_choice_gives(tmp_path, choice, device, jit, amp, expect):
    cfg = unet_cfg(str(tmp_path), tmp_path, memory_format=choice, enable_jit=jit, amp_mode=amp)
    fmt, why = make_task(cfg).memory_format(torch.device(device))
    assert fmt == expect
    if choice == "auto" and jit:
        assert "torch.compile fails" in why
    if fmt == CL and choice == "auto":
        assert why == f"memory_format auto: {amp} on a GPU"


def test_channels_last_with_compile_is_refused_in_one_line(tmp_path, monkeypatch):
    cfg = unet_cfg(str(tmp_path), tmp_path, memory_format="channels_last", enable_jit=True)
    with pytest.raises(ConfigError, match="drop --enable_jit, or use --memory_format auto"):
        make_task(cfg).memory_format(torch.device("cuda"))
    assert make_task(cfg).memory_format(CPU)[0] == CL  # compiles on a CPU
    assert make_task(cfg).compile_options(CL) == {}
    # once options are known under which it compiles: taken, and given to torch.compile
    monkeypatch.setattr(cosmo, "CHANNELS_LAST_COMPILE_OPTIONS", {"size_asserts": True})
    assert make_task(cfg).memory_format(torch.device("cuda"))[0] == CL
    cfg = dataclasses.replace(cfg, memory_format="auto", amp_mode="bf16")
    assert make_task(cfg).memory_format(torch.device("cuda"))[0] == CL
    assert make_task(cfg).compile_options(CL) == {"size_asserts": True}
    assert make_task(cfg).compile_options(torch.contiguous_format) == {}


def test_the_vit_has_no_memory_format(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting 'memory_format' .*: a setting of "
                                          "unet configs, not of vit ones: remove it"):
        build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                     {"memory_format": "channels_last", "expdir": str(tmp_path)})
    vit = build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                       {"expdir": str(tmp_path)})
    assert make_task(vit).memory_format(torch.device("cuda")) == (torch.contiguous_format, "")


# ---------------------------------------------------------------------- the same training


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_channels_last_trains_as_the_default_layout(cosmo32, tmp_path, amp):
    ref = run(cosmo32, tmp_path / "contiguous", amp_mode=amp, memory_format="contiguous")
    cl = run(cosmo32, tmp_path / "cl", amp_mode=amp, memory_format="channels_last")
    assert ref.memory_format == torch.contiguous_format and cl.memory_format == CL
    assert ref.batch_layouts == {(False, False)} and cl.batch_layouts == {(True, True)}
    five_d = [p for p in cl.model.parameters() if p.dim() == 5]
    assert five_d and all(channels_last(p) for p in five_d)
    assert cl.grad_layouts == {(True,) * len(five_d)}
    assert ref.grad_layouts == {(False,) * len(five_d)}
    assert all(channels_last(cl.optimizer.state[p]["exp_avg"]) for p in five_d)
    rtol, atol = (1e-5, 1e-7) if amp == "none" else (2e-2, 1e-4)
    torch.testing.assert_close(cl.losses, ref.losses, rtol=rtol, atol=atol)
    assert_same_weights(cl, ref, rtol=rtol, atol=atol if amp == "none" else 1e-3)
    for key in ("loss", "metrics", "baseline_loss", "baseline_metrics"):  # validation
        assert cl.last_val[key] == pytest.approx(ref.last_val[key], rel=rtol), key


@pytest.mark.compile
def test_compiled_channels_last_trains_as_eager_on_a_cpu(cosmo32, tmp_path):
    """torch.compile of the channels-last U-Net works on a CPU (not on a GPU: see
    ``CHANNELS_LAST_COMPILE_OPTIONS``)."""
    eager = run(cosmo32, tmp_path / "eager", steps=2, memory_format="channels_last")
    jit = run(cosmo32, tmp_path / "jit", steps=2, memory_format="channels_last", enable_jit=True)
    assert jit.batch_layouts == {(True, True)}
    torch.testing.assert_close(jit.losses, eager.losses, rtol=1e-4, atol=1e-6)
    assert_same_weights(jit, eager, rtol=1e-3, atol=1e-5)
    # compile_blocks: each encoder and decoder stage compiled on its own, the rest eager
    stages = run(cosmo32, tmp_path / "stages", steps=2, memory_format="channels_last",
                 enable_jit=True, compile_blocks=True)
    assert all(m._compiled_call_impl is not None for m in [*stages.model.down, *stages.model.up])
    torch.testing.assert_close(stages.losses, eager.losses, rtol=1e-4, atol=1e-6)
    assert_same_weights(stages, eager, rtol=1e-3, atol=1e-5)


def test_resume_across_formats_and_checkpoints_in_the_default_layout(cosmo32, tmp_path):
    # the uninterrupted run is the first half of contiguous -> channels_last too: its
    # checkpoints (every 2 steps) change none of its steps
    whole = run(cosmo32, tmp_path / "contiguous-channels_last", steps=4,
                memory_format="contiguous", checkpoint_every=2)
    for first, second in (("contiguous", "channels_last"), ("channels_last", "contiguous")):
        name = f"{first}-{second}"
        ckpts = whole.ckpt_dir if first == "contiguous" else \
            run(cosmo32, tmp_path / name, steps=4, memory_format=first, checkpoint_every=2).ckpt_dir
        state, _ = checkpoint.load_latest(ckpts)
        saved = [t for t in state["model"].values() if t.dim() == 5]
        saved += [s["exp_avg"] for s in state["optimizer"]["state"].values()
                  if s["exp_avg"].dim() == 5]
        assert saved and all(t.is_contiguous() for t in saved)
        os.remove(checkpoint.path_for(ckpts, 4))  # as if stopped after step 2
        resumed = run(cosmo32, tmp_path / name, steps=4, memory_format=second, resume="true")
        assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-5, abs=1e-7)
        assert_same_weights(resumed, whole, rtol=1e-5, atol=1e-7)
        want = second == "channels_last"
        for p in resumed.model.parameters():
            if p.dim() == 5:
                m = resumed.optimizer.state[p]
                assert channels_last(p) == channels_last(m["exp_avg"]) == \
                    channels_last(m["exp_avg_sq"]) == want


def test_the_graph_steps_static_buffers_take_the_batches_layout(cosmo32, tmp_path):
    graph = run(cosmo32, tmp_path / "graph", steps=5, cls=NotingGraphTrainer,
                memory_format="channels_last")
    assert graph.step_graph.ops.replays == 5 - 3
    assert all(channels_last(t) for t in graph.step_graph.static)
    eager = run(cosmo32, tmp_path / "eager", steps=5, memory_format="contiguous")
    torch.testing.assert_close(graph.losses, eager.losses, rtol=1e-5, atol=1e-7)

    step = StepGraph(lambda x, y, probe: (x.sum(),), lambda: None, ReplayOnCPU(), 1)
    step(torch.ones(2, 3, 4, 4, 4).contiguous(memory_format=CL), torch.ones(2, 1, 4, 4, 4))
    assert channels_last(step.static[0]) and step.static[1].is_contiguous()


# ---------------------------------------------------------------------- the batches


@pytest.mark.parametrize("method", ["copy", "gather"])
def test_the_device_loader_cuts_channels_last_crops(cosmo32, tmp_path, method):
    cfg = dataclasses.replace(unet_cfg(cosmo32, tmp_path, data_loader_config="device",
                                       Nsamples=8, Nsamples_val=5), data_size=8)
    ref = build_loaders(cfg, 1, 0, 4, CPU)
    cl = build_loaders(cfg, 1, 0, 4, CPU, None, CL)
    for ld in (ref, cl):
        ld.train.gather.method = ld.valid.gather.method = method
    for which in ("train", "valid"):
        for (x0, y0), (x1, y1) in zip(getattr(ref, which), getattr(cl, which)):
            assert x0.is_contiguous() and y0.is_contiguous()
            assert channels_last(x1) and channels_last(y1)
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_other_batches_are_converted_once_on_the_device(cosmo32, tmp_path):
    cfg = unet_cfg(cosmo32, tmp_path, data_loader_config="synthetic")
    fake = types.SimpleNamespace(device=CPU, task=make_task(cfg), memory_format=CL)
    synthetic = build_loaders(cfg, 1, 0, 4, CPU, None, CL)
    x, y = next(iter(synthetic.train))
    assert channels_last(x) and channels_last(y)
    x1, y1 = train_script.Trainer.to_device(fake, x, y)
    assert x1 is x and y1 is y  # already in the layout: no copy
    x, y = next(iter(build_loaders(unet_cfg(cosmo32, tmp_path), 1, 0, 4, CPU).train))
    assert x.is_contiguous()
    x1, y1 = train_script.Trainer.to_device(fake, x, y)
    assert channels_last(x1) and channels_last(y1) and torch.equal(x1, x)


# ---------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@test_cuda_graph.needs_gpu
def test_on_a_gpu_channels_last_eager_and_captured(cosmo32, tmp_path):
    """channels_last on a GPU: channels-last weights and batches (the device loader's gather),
    the losses of the default layout (to TF32 and cuDNN's algorithm choice), and a captured step
    (train_graph.py, the real CUDA graph) on channels-last static buffers."""
    kw = dict(steps=5, data_loader_config="device")
    ref = run(cosmo32, tmp_path / "contiguous", memory_format="contiguous", **kw)
    cl = run(cosmo32, tmp_path / "channels_last", memory_format="channels_last", **kw)
    assert cl.device.type == "cuda" and cl.memory_format == CL
    assert cl.batch_layouts == {(True, True)} and ref.batch_layouts == {(False, False)}
    torch.testing.assert_close(cl.losses, ref.losses, rtol=1e-2, atol=1e-4)
    cfg = unet_cfg(cosmo32, tmp_path / "graph", num_iters=5, data_loader_config="device",
                   memory_format="channels_last")
    graph = NotingGraphTrainer(cfg, setup_runtime(cfg))  # the real CudaGraphOps
    graph.fit()
    assert graph.step_graph.captured and all(channels_last(t) for t in graph.step_graph.static)
    torch.testing.assert_close(graph.losses, cl.losses, rtol=1e-2, atol=1e-4)
