"""The memory a training step needs, estimated before the step allocates it (fake tensors), and
the start-up warning when it exceeds what the rank has (``observe.memory``)."""
import os

import pytest
import torch

from conftest import ROOT
from test_training import TINY_VIT
from observe.memory import MemoryProbe, estimated_step_bytes, memory_warning
from settings.parse import build_config
from tasks import make_task

@pytest.mark.parametrize("yaml,overrides,amp", [
    ("config/ViT.yaml", {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 2,
                         "num_heads": 2}, None),
    ("config/ViT.yaml", {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 2,
                         "num_heads": 2}, torch.bfloat16),
    ("config/UNet.yaml", {"data_size": 32, "base_width": 4}, None),
])
def test_the_estimate_is_what_a_real_step_counts(yaml, overrides, amp):
    """The estimate, made on fake tensors, equals the CPU probe's count of a real step after the
    optimizer's state exists: weights, gradients, Adam's moments and the saved activations."""
    cfg = build_config(os.path.join(ROOT, yaml), "quickstart", overrides)
    task = make_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(3, *task.sample_shape())
    for _ in range(2):  # the second step has Adam's moments, as every later one
        opt.zero_grad(set_to_none=True)
        probe = MemoryProbe(torch.device("cpu"), model, opt)
        with probe.step():
            with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                out = model(x)
            probe.forward_done()
            out.float().square().mean().backward()
        opt.step()
    estimate = estimated_step_bytes(model, task.sample_shape(), 3, torch.device("cpu"), amp)
    steps = sum(8 for p in model.parameters())  # Adam's 'step' per tensor, left out of the estimate
    assert abs(estimate - (probe.peak - steps)) <= 0.01 * probe.peak, (estimate, probe.peak)


def test_a_step_too_big_for_the_rank_is_named_before_it_starts(monkeypatch):
    cfg = build_config(os.path.join(ROOT, "config/ViT.yaml"), "quickstart")
    model = make_task(cfg).build_model()
    shape = make_task(cfg).sample_shape()
    need = estimated_step_bytes(model, shape, 16, torch.device("cpu"), None)
    monkeypatch.setattr("observe.memory.available_bytes", lambda device, ranks: need - 1)
    line = memory_warning(model, shape, 16, torch.device("cpu"), None, 1)
    assert line is not None and f"{need / 1024**3:.1f} GB" in line and "--global_batch_size" in line
    monkeypatch.setattr("observe.memory.available_bytes", lambda device, ranks: need)
    assert memory_warning(model, shape, 16, torch.device("cpu"), None, 1) is None


def test_a_run_names_a_step_too_big_for_the_machine_in_one_line(tmp_path, era5_root,
                                                                 monkeypatch):
    """The trainer's start-up estimates its step (rank 0) and warns in one line when this
    machine has less; a run that fits says nothing."""
    from engine.runtime import setup_runtime
    from train import Trainer

    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_epochs="1")

    def start(run_num):
        cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", dict(ov, run_num=run_num))
        trainer = Trainer(cfg, setup_runtime(cfg))
        trainer.close()
        with open(os.path.join(trainer.run_dir, "out.log")) as f:
            return [line for line in f if " - Memory: a training step needs" in line]

    assert start("0") == []
    monkeypatch.setattr("observe.memory.available_bytes", lambda device, ranks: 1000)
    lines = start("1")
    assert len(lines) == 1 and "more than the 0.0 GB available" in lines[0], lines


def test_a_step_longer_than_a_schedulers_grace_is_named_once(tmp_path, era5_root, monkeypatch):
    """A stop signal waits for the end of the step it comes in: a step longer than the grace a
    scheduler commonly gives (60 s; 0 here) is said in the log once, with the remedy."""
    from engine.runtime import setup_runtime
    from train import Trainer

    monkeypatch.setattr("observe.run_log.STOP_GRACE_S", 0)
    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_epochs="1")
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    trainer = Trainer(cfg, setup_runtime(cfg))
    trainer.train_epoch()
    trainer.close()
    with open(os.path.join(trainer.run_dir, "out.log")) as f:
        lines = [line for line in f if " - Stop: step " in line]
    assert len(lines) == 1 and "--signal=B:USR1@SECONDS" in lines[0], lines
