"""Gradient accumulation under FSDP on 2 real gloo ranks: a reduce-scatter in every micro-batch's
backward (the default: no rank holds the whole gradient between micro-batches) and, with
``--fsdp_reduce_each_microbatch false``, the whole unsharded gradient kept on every rank and
reduce-scattered once per step. Both take the serial run's steps.

The tiny ViT of tests/test_fsdp.py takes 3 steps of 4 micro-batches (one sample each per rank)
with the gradient clipped below its own norm; the gradients each rank holds are read before
every training forward pass (``benchmarks.fsdp_accumulation.held_gradient_bytes``). Tolerances
as in tests/test_fsdp.py: losses and gradient norms to 1e-5 relative, weights to 1e-5 relative
+2e-6 absolute.
"""
import os

import numpy as np
import pytest
import torch

from distributed_harness import run_ranks
from engine.runtime import setup_runtime
from engine.sharding import resharded
from observe.memory import tensor_bytes
from test_ddp import CLIP, Recording, assert_close, vit_cfg, write_data

ACCUM = 4
RUN = dict(num_iters=3, grad_accum_steps=ACCUM, max_grad_norm=CLIP)


def run_vit(data, expdir, fsdp, **kw):
    """Losses, gradient norms and final weights (serial layout), and before each training forward
    pass (``ACCUM`` per step): (sharded gradient bytes, unsharded gradient bytes, whether every
    gradient that exists is a DTensor sharded on dim 0)."""
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.fsdp_accumulation import held_gradient_bytes

    cfg = vit_cfg(data, expdir, fsdp=fsdp, **(RUN | kw))
    tr = Recording(cfg, setup_runtime(cfg))
    held = []

    def note(module, args):
        if module.training and torch.is_grad_enabled():
            grads = [p.grad for p in tr.model.parameters() if p.grad is not None]
            sharded = all(isinstance(g, DTensor) and g.placements == (Shard(0),) for g in grads)
            held.append((*held_gradient_bytes(tr.model), bool(grads) and sharded))

    tr.model.register_forward_pre_hook(note, prepend=True)  # before FSDP gathers the root
    tr.fit()
    resharded(tr.model)
    return dict(losses=tr.step_losses, norms=tr.step_norms, held=held,
                final=tr.sharding.model_state(tr.model),
                params=tensor_bytes(tr.model.parameters()), kind=type(tr.model).__name__)


def rank_runs(era5, exp):
    return {reduce_each: run_vit(era5, os.path.join(exp, str(reduce_each)), True,
                                 fsdp_reduce_each_microbatch=str(reduce_each).lower())
            for reduce_each in (True, False)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("fsdp_accum_data"))


@pytest.fixture(scope="module")
def serial(data):
    torch.manual_seed(0)
    return run_vit(data["era5"], str(data["base"] / "serial"), False)


@pytest.fixture(scope="module")
def ranks(data):
    return run_ranks(rank_runs, 2, data["era5"], str(data["base"] / "ws2"), timeout=400)


@pytest.mark.parametrize("reduce_each", [True, False], ids=["per_microbatch", "once_per_step"])
def test_accumulation_under_fsdp_equals_serial(ranks, serial, reduce_each):
    assert min(serial["norms"]) > CLIP  # every step clips
    runs = [r[reduce_each] for r in ranks]
    assert all(r["kind"] == "FSDPViT" for r in runs)
    np.testing.assert_allclose(np.mean([r["losses"] for r in runs], axis=0), serial["losses"],
                               rtol=1e-5)
    for r in runs:
        np.testing.assert_allclose(r["norms"], serial["norms"], rtol=1e-5)
        assert_close(r["final"], serial["final"], 1e-5, 2e-6, "ViT weight after 3 steps")


def test_default_holds_only_sharded_gradients_between_microbatches(ranks, serial):
    """After every micro-batch's backward the gradients are this rank's DTensor shards: FSDP
    holds no unsharded gradient into the next micro-batch."""
    whole = 4 * sum(v.numel() for v in serial["final"].values())
    for r in ranks:
        run = r[True]
        assert len(run["held"]) == 3 * ACCUM
        for step in range(3):
            first, *later = run["held"][step * ACCUM:(step + 1) * ACCUM]
            assert first == (0, 0, False)  # cleared after the previous step
            for sharded, unsharded, as_shards in later:
                assert unsharded == 0 and as_shards
                assert sharded == run["params"] < 0.55 * whole  # the shards' size: about half


def test_accumulating_unsharded_holds_the_whole_gradient(ranks, serial):
    """--fsdp_reduce_each_microbatch false: between micro-batches every rank holds the whole fp32
    gradient (as benchmarks.memory_model counts it) and no sharded one."""
    from benchmarks.memory_model import predict_config

    whole = 4 * sum(v.numel() for v in serial["final"].values())
    cfg = vit_cfg("/tmp", "/tmp", fsdp="true", fsdp_reduce_each_microbatch="false", **RUN)
    assert predict_config(cfg, 2, "flash", "cpu").unsharded_grads == whole
    assert predict_config(vit_cfg("/tmp", "/tmp", fsdp="true", **RUN), 2, "flash",
                          "cpu").unsharded_grads == 0
    for r in ranks:
        run = r[False]
        assert len(run["held"]) == 3 * ACCUM
        for step in range(3):
            first, *later = run["held"][step * ACCUM:(step + 1) * ACCUM]
            assert first == (0, 0, False)
            assert all(held == (0, whole, False) for held in later)
