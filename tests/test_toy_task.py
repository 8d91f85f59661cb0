"""A third science problem added from this one file, without touching the engine: its config
class, its data set and its task registered beside the ViT's and the U-Net's, then trained a few
steps by train.py's engine, serially and on 2 data-parallel gloo ranks (which must end with the
serial run's weights: the same global batches, the gradients averaged).

The problem: recover a fixed linear map from noisy samples, y = W x + noise, x a vector of
``width`` values; the model is one linear layer, the loss the per-sample mean squared error.
"""
import dataclasses
import os
from typing import Literal

import numpy as np
import pytest
import torch
import torch.nn as nn

from datapipe import data_sets
from datapipe.batch_dataset import BatchReadDataset
from distributed_harness import run_ranks
from engine.runtime import setup_runtime
from settings.config import Config, register_config
from settings.parse import build_config
from tasks import register
from tasks.base import Task

WIDTH = 6


@dataclasses.dataclass
class ToyConfig(Config):
    model: Literal["toy"] = dataclasses.field(default="toy", metadata={"help": "the toy problem"})
    width: int = dataclasses.field(default=WIDTH, metadata={"help": "vector length", "min": 1,
                                                            "size": True})
    n_train: int = dataclasses.field(default=48, metadata={"help": "training samples", "min": 1})
    n_valid: int = dataclasses.field(default=8, metadata={"help": "validation samples", "min": 1})


class LinearSamples(BatchReadDataset):
    """Sample i: x from a seeded normal draw, y = W x + 0.01 noise (W fixed by the seed)."""

    def __init__(self, width, n, seed, split):
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((width, width)).astype(np.float32)
        rng = np.random.default_rng([seed, 1 if split == "train" else 2])
        self.x = rng.standard_normal((n, width)).astype(np.float32)
        self.y = self.x @ w.T + 0.01 * rng.standard_normal((n, width)).astype(np.float32)
        self.sample_shapes = ((width,), (width,))

    def __len__(self):
        return len(self.x)

    def read_batch(self, keys, x, y):
        for j, key in enumerate(keys):
            i = key[1] if isinstance(key, tuple) else key
            x[j], y[j] = self.x[i], self.y[i]


class ToyData:
    shuffle, row_bands = True, False

    def __init__(self, cfg):
        self.cfg = cfg

    def missing(self):
        return []  # made in memory, never on disk

    def synthesize(self):
        pass

    def datasets(self, rows=None):
        c = self.cfg
        return (LinearSamples(c.width, c.n_train, c.seed, "train"),
                LinearSamples(c.width, c.n_valid, c.seed, "valid"))

    def generated_counts(self):
        return self.cfg.n_train, self.cfg.n_valid

    def describe_generated_counts(self):
        return f"{self.cfg.n_train} training and {self.cfg.n_valid} validation samples"

    def generated_batch(self, keys, split, rows=None):
        ds = self.datasets()[0 if split == "train" else 1]
        x, y = (np.empty((len(keys), self.cfg.width), np.float32) for _ in range(2))
        ds.read_batch(keys, x, y)
        return x, y


class MSE(nn.Module):
    def forward(self, pred, y):
        return ((pred - y) ** 2).mean(dim=1)  # per sample


class ToyTask(Task):
    baseline_name = "predict zero"
    shards_model = False

    def __init__(self, cfg):
        self.cfg, self.loss = cfg, MSE()

    def build_model(self):
        return nn.Linear(self.cfg.width, self.cfg.width)

    def device_batch(self, x, y):
        return x, y

    def metric_sums(self, pred, y):
        return (pred - y).abs().mean(dim=1, keepdim=True).sum(dim=0)  # (1,)

    def baseline_pred(self, x, y):
        return torch.zeros_like(y)

    def metric_lines(self, metrics, base):
        return [f"  Val MAE {metrics[0]:.4f}" + ("" if base is None else f", zero {base[0]:.4f}")]

    def metric_scalars(self, metrics):
        return {"MAE/valid": float(metrics[0])}

    def picture(self, x, y, pred):
        return np.zeros((4, 8, 3), np.uint8)

    def forward_flops(self):
        flops = 2 * self.cfg.width ** 2
        return flops, flops

    def flops_per_sample(self, epoch=0):
        return 3 * self.forward_flops()[0] - self.forward_flops()[1]

    def fp32_in_tf32(self):
        return torch.backends.cuda.matmul.allow_tf32

    def from_reference(self, sd, model):
        return sd


def register_toy():
    """Register the toy problem in this process (the config family, its data set, its task)."""
    register_config("toy", ToyConfig)
    data_sets.register(ToyConfig, ToyData)
    register(ToyConfig, ToyTask)


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch):
    """Registered for the test only: the other tests' walks over the config families do not
    meet it."""
    from settings.config import CONFIG_CLASSES
    from tasks.registry import _TASKS

    monkeypatch.setitem(CONFIG_CLASSES, "toy", ToyConfig)
    monkeypatch.setitem(data_sets._DATA.classes, ToyConfig, ToyData)
    monkeypatch.setitem(_TASKS.classes, ToyConfig, ToyTask)


def write_yaml(tmp):
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "toy.yaml"), "w") as f:
        f.write("toy:\n  model: toy\n  lr: 0.2\n  num_epochs: 4\n  global_batch_size: 8\n"
                "  log_every: 2\n  num_data_workers: 0\n")
    return tmp


def toy_config(tmp, **over):
    yaml_path = os.path.join(tmp, "toy.yaml")
    over = {"expdir": os.path.join(tmp, "logs"), "data_root": os.path.join(tmp, "data"), **over}
    return build_config(yaml_path, "toy", {k: str(v) for k, v in over.items()})


def train_toy(tmp, **over):
    """Train the toy config with train.py's engine; the final weights and validation losses."""
    import train

    cfg = toy_config(tmp, **over)
    trainer = train.Trainer(cfg, setup_runtime(cfg))
    trainer.fit()
    trainer.loaders.close()
    text = open(os.path.join(trainer.run_dir, "out.log")).read()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, text


def rank_toy(tmp):
    register_toy()  # a fresh process
    return train_toy(tmp)


def test_a_third_task_trains_serially_and_on_two_ranks(tmp_path):
    weights, text = train_toy(write_yaml(str(tmp_path / "serial")))
    losses = [float(v) for v in __import__("re").findall(r"Avg val loss=([0-9.e+-]+)", text)]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], text[-2000:]
    assert "Val MAE" in text and "Done: 24 steps" in text, text[-2000:]
    ranks = run_ranks(rank_toy, 2, write_yaml(str(tmp_path / "ddp")), timeout=240)
    for rank_weights, _ in ranks:
        for k, v in weights.items():
            assert torch.allclose(rank_weights[k], v, atol=1e-6), k


def test_the_third_task_is_its_own_config_family(tmp_path):
    """Its settings parse with its own bounds, and --data_loader_config synthetic serves its
    generated batches."""
    cfg = toy_config(write_yaml(str(tmp_path)), width=3)
    assert isinstance(cfg, ToyConfig) and cfg.width == 3
    from settings.errors import ConfigError
    with pytest.raises(ConfigError, match="width"):
        toy_config(str(tmp_path), width=0)
    from datapipe.data_loader import build_loaders

    ld = build_loaders(toy_config(str(tmp_path), data_loader_config="synthetic"), 1, 0, 4,
                       torch.device("cpu"))
    x, y = next(iter(ld.train))
    assert x.shape == y.shape == (4, WIDTH)


def test_compile_blocks_is_refused_for_a_task_without_blocks(tmp_path):
    import train
    from settings.errors import ConfigError

    cfg = toy_config(write_yaml(str(tmp_path)), enable_jit="true", compile_blocks="true")
    with pytest.raises(ConfigError, match="ToyTask's model names no blocks .* drop "
                                          "--compile_blocks"):
        train.Trainer(cfg, setup_runtime(cfg))
