"""Rollout training of the ViT (rollout_steps, rollout_schedule, rollout_checkpointing): the loss
averaged over N autoregressive steps, each fed the model's own output, from windows of N + 1
states of one year.

- one step (the default, rollout_steps 1, rollout_schedule 0:1) is today's step, bitwise: the
  same losses and weights, and the first step's gradients those of loss(model(x), y);
- two steps: the loss and gradients of a hand-written two-step rollout on the same batch; with
  rollout_checkpointing the same (recomputed in the backward pass);
- the loader's windows never cross a year (two years of different lengths), and each target is
  the state k dt after the input;
- a run under rollout_schedule 0:1,1:2 stopped after its first epoch and resumed equals the
  uninterrupted run (the steps follow from the epoch);
- validation logs the loss per lead step; bad settings are refused in one line;
- 2 gloo ranks (DDP, with and without checkpointing; FSDP; tensor and context parallelism)
  equal the single process; torch.compile with bf16 and checkpointing trains as eager does.
"""
import copy
import os
import sys

import numpy as np
import pytest
import torch

import preloaded
from conftest import ROOT, era5_value, write_era5
from datapipe.era5_data import ERA5Dataset
from distributed_harness import run_ranks
from engine.runtime import setup_runtime
from settings.parse import build_config
from tasks.era5 import RelativeL2
from test_training import TINY_VIT as TINY_VIT_ARGS, run_dir, tb_scalars, train
from train import Trainer

VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")
TINY = dict(img_size="[16,32]", patch_size="4", embed_dim="32", depth="1", num_heads="2",
            global_batch_size="4", base_batch_size="4", lr="1e-3", warmup_steps="0",
            synthesize_if_missing="false", log_every="1", num_data_workers="0", dropout="0")


class Noting(Trainer):
    """Notes each step's batch (on the device, normalised) and loss, the gradients the optimizer
    applies, and the weights the run started from."""

    def __init__(self, cfg, rt):
        super().__init__(cfg, rt)
        self.start = None if cfg.fsdp else copy.deepcopy(self.model)  # (FSDP: no deepcopy)
        self.batches, self.losses, self.grads = [], [], []
        self.optimizer.register_step_pre_hook(lambda *_: self.grads.append(
            [p.grad.detach().clone() for p in self.model.parameters()]))

    def train_step(self, x, y, probe):
        self.batches.append((x.clone(), y.clone()))
        loss, norm = super().train_step(x, y, probe)
        self.losses.append(loss.item())
        return loss, norm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout")
    return dict(era5=write_era5(str(base / "era5"), steps=20), base=base)


def run(data, name, steps=3, **kw) -> Noting:
    cfg = build_config(VIT_YAML, "quickstart", dict(
        TINY, data_root=data["era5"], expdir=str(data["base"] / name), num_iters=str(steps),
        **{k: str(v) for k, v in kw.items()}))
    tr = Noting(cfg, setup_runtime(cfg))
    tr.fit()
    return tr


def weights(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


def test_one_step_is_todays_step_bitwise(data):
    runs = [run(data, "default"), run(data, "steps1", rollout_steps=1),
            run(data, "schedule01", rollout_schedule="0:1")]
    ref = runs[0]
    for tr in runs[1:]:
        assert tr.losses == ref.losses
        assert all(torch.equal(a, b) for a, b in zip(weights(tr), weights(ref)))
    # the first step: loss(model(x), y) of the batch, averaged over its samples
    x, y = ref.batches[0]
    assert y.shape == x.shape  # one target per sample, as before
    model = ref.start
    loss = RelativeL2()(model(x), y).sum() / x.shape[0]
    loss.backward()
    assert loss.item() == ref.losses[0]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref.grads[0]))


def two_step_by_hand(tr):
    """The first batch's two-step loss and gradients, written out."""
    x, y = tr.batches[0]
    model = copy.deepcopy(tr.start)
    first = model(x)
    second = model(first)
    loss = ((RelativeL2()(first, y[:, 0]) + RelativeL2()(second, y[:, 1])) / 2).mean()
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
def test_two_steps_equal_a_hand_written_rollout(data, checkpointing):
    tr = run(data, f"two-{checkpointing}", steps=1, rollout_steps=2,
             rollout_checkpointing=checkpointing)
    x, y = tr.batches[0]
    assert y.shape == (x.shape[0], 2, *x.shape[1:])
    loss, grads = two_step_by_hand(tr)
    assert loss == pytest.approx(tr.losses[0], rel=1e-6)
    for got, want in zip(tr.grads[0], grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_checkpointing_gives_the_same_steps(data):
    a = run(data, "ckpt-off", rollout_steps=3)
    b = run(data, "ckpt-on", rollout_steps=3, rollout_checkpointing="true")
    assert a.losses == pytest.approx(b.losses, rel=1e-6)
    for p, q in zip(weights(a), weights(b)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", [{}, {"loss_latitude_weights": "true",
                                         "loss_variable_weights": "t2m=2"}], ids=["plain", "weighted"])
def test_a_rollouts_loss_is_the_mean_of_its_steps(data, weights):
    from tasks import make_task
    cfg = build_config(VIT_YAML, "quickstart", dict(TINY, data_root=data["era5"], num_iters="1",
                                                    **weights))
    loss = make_task(cfg).loss
    pred, y = torch.randn(2, 3, 20, 16, 32), torch.randn(2, 3, 20, 16, 32)
    want = torch.stack([loss(pred[:, k], y[:, k]) for k in range(3)]).mean(0)
    assert want.shape == (2,) and torch.allclose(loss(pred, y), want)


@pytest.mark.compile
def test_compiled_bf16_checkpointed_rollout_trains_like_eager(data):
    # two steps: the second's loss is that of the weights the compiled backward updated
    eager = run(data, "eager-bf16", steps=2, rollout_steps=2, amp_mode="bf16")
    compiled = run(data, "jit-bf16", steps=2, rollout_steps=2, amp_mode="bf16", enable_jit="true",
                   rollout_checkpointing="true")
    assert len(compiled.losses) == 2
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-3)


@pytest.mark.parametrize("inmem", [False, True], ids=["lowmem", "inmem"])
@pytest.mark.parametrize("steps,dt", [(1, 1), (3, 1), (2, 2)])
def test_windows_never_cross_a_year(tmp_path, inmem, steps, dt):
    root = str(tmp_path)
    lengths = {2016: 10, 2017: 7}
    for year, n in lengths.items():
        write_era5(root, years={"train": [year]}, steps=n, h=8, w=16)
    ds = ERA5Dataset(os.path.join(root, "train"), root, (8, 16), dt=dt, n_in=3, n_out=3,
                     inmem=inmem, steps=steps)
    per_year = [n - steps * dt for n in lengths.values()]  # samples of each year
    assert len(ds) == sum(per_year)
    expected = [(0, t) for t in range(per_year[0])] + [(1, t) for t in range(per_year[1])]
    assert [ds.locate(i) for i in range(len(ds))] == expected
    x_shape, y_shape = ds.sample_shapes
    assert x_shape == (3, 8, 16) and y_shape == ((steps,) if steps > 1 else ()) + (3, 8, 16)
    # each year's first and last window, and the first of the next: states t, t + dt, ..., of
    # the input's own year
    ends = [0, per_year[0] - 1, per_year[0], len(ds) - 1]
    x, y = ds.read(ends)
    y = y.reshape(len(ends), steps, 3, 8, 16)
    for j, i in enumerate(ends):
        k, t = ds.locate(i)
        year = list(lengths)[k]
        assert t + steps * dt < lengths[year]
        want = [np.stack([era5_value(year, s, c, 8, 16) for c in range(3)])
                for s in [t] + [t + (n + 1) * dt for n in range(steps)]]
        np.testing.assert_allclose(x[j], want[0], rtol=1e-6)
        for n in range(steps):
            np.testing.assert_allclose(y[j, n], want[n + 1], rtol=1e-6)


def test_a_year_too_short_for_the_window_is_refused(tmp_path):
    root = write_era5(str(tmp_path), years={"train": [2016]}, steps=4, h=8, w=16)
    with pytest.raises(Exception, match=r"holds 4 steps, not more than rollout_steps=2 x dt=2"):
        ERA5Dataset(os.path.join(root, "train"), root, (8, 16), dt=2, n_in=3, n_out=3, steps=2)


def test_resume_in_the_middle_of_a_schedule_is_exact(tmp_path, data):
    # 2 years x 18 windows // 4 = 9 steps an epoch; a constant learning rate, so that the
    # stopped run's shorter end leaves the schedule as the uninterrupted run's
    common = TINY_VIT_ARGS + ["--data_root", data["era5"], "--rollout_schedule", "0:1,1:2",
                              "--lr", "1e-3", "--end_lr", "1e-3", "--log_every", "1"]
    ref, exp = str(tmp_path / "ref"), str(tmp_path / "stopped")
    train(common + ["--expdir", ref, "--num_epochs", "2"])
    train(common + ["--expdir", exp, "--num_epochs", "1"])  # stops after epoch 1
    r = train(common + ["--expdir", exp, "--num_epochs", "2", "--resume"])
    assert "Val loss per lead step, model / persistence:" in r.stdout
    final = "ckpt_00000018.pt"
    a = torch.load(os.path.join(run_dir(ref), "checkpoints", final), weights_only=True)
    b = torch.load(os.path.join(run_dir(exp), "checkpoints", final), weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    board = tb_scalars(os.path.join(run_dir(ref), "tensorboard"))
    for tag in ("Loss/train", "Loss/valid", "Loss/valid_lead_1", "Loss/valid_lead_2"):
        want = [e.value for e in board.Scalars(tag)]
        got = [e.value for e in tb_scalars(os.path.join(run_dir(exp), "tensorboard")).Scalars(tag)]
        assert got == want and want, tag
    # the validation loss: the mean of the lead steps'
    leads = [[e.value for e in board.Scalars(f"Loss/valid_lead_{k}")] for k in (1, 2)]
    assert [e.value for e in board.Scalars("Loss/valid")] == pytest.approx(
        [(a + b) / 2 for a, b in zip(*leads)], rel=1e-6)


@pytest.mark.parametrize("args,message", [
    (["--rollout_steps", "2", "--n_out_channels", "10"],
     "error: rollout of 2 steps feeds the model's output back as its input, and n_in_channels=20 "
     "!= n_out_channels=10: give both the same number of channels"),
    (["--rollout_schedule", "1:1,20:2"],
     "error: rollout_schedule=1:1,20:2 must start at epoch 0 and its epochs increase: e.g. "
     "--rollout_schedule 0:1,20:2,40:4"),
    (["--rollout_schedule", "0:1,20:2,10:4"],
     "error: rollout_schedule=0:1,20:2,10:4 must start at epoch 0 and its epochs increase"),
    (["--rollout_schedule", "0:1,20"], "error: rollout_schedule=0:1,20 is not a list of "
     "EPOCH:STEPS entries with STEPS >= 1"),
    (["--rollout_schedule", "0:2", "--data_loader_config", "dali-lowmem"],
     "error: rollout of 2 steps needs windows of 3 states, which data_loader_config=dali-lowmem "
     "cannot give: use --data_loader_config lowmem or inmem"),
])
def test_bad_rollout_settings_are_refused_in_one_line(tmp_path, args, message):
    r = train(["--expdir", str(tmp_path / "logs"), "--num_epochs", "1", *args], check=False)
    assert r.returncode == 2 and r.stderr.startswith(message) and r.stderr.count("\n") == 1, \
        r.stderr
    assert not os.path.exists(tmp_path / "logs")


def test_cuda_graph_step_refuses_a_rollout(tmp_path):
    r = preloaded.run([sys.executable, "train_graph.py", "--rollout_steps", "2", "--num_epochs",
                       "1", "--expdir", str(tmp_path / "logs")], cwd=ROOT, capture_output=True,
                      text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and r.stderr.startswith(
        "error: rollout of 2 steps is not captured as a CUDA graph: train with train.py"), r.stderr
    assert not os.path.exists(tmp_path / "logs")


def serial_weights(tr) -> dict:
    """The model's weights by name in the serial layout, however the run shards them."""
    return {k: v.float() for k, v in tr.sharding.model_state(tr.model).items()}


def ranks_rollout(era5, exp):
    """On each gloo rank: three steps of two-step rollouts under DDP (stored and checkpointed),
    FSDP, tensor and context parallelism; the losses (means over the ranks) and the weights."""
    import torch.distributed as dist
    out = {}
    for name, kw in (("ddp", {}), ("ddp-ckpt", {"rollout_checkpointing": "true"}),
                     ("fsdp", {"fsdp": "true"}), ("tp", {"tensor_parallel": "2"}),
                     ("cp-ckpt", {"context_parallel": "2", "rollout_checkpointing": "true"})):
        tr = run(dict(era5=era5, base=exp), name, rollout_steps=2, **kw)
        losses = torch.tensor(tr.losses)
        dist.all_reduce(losses)
        out[name] = dict(losses=(losses / dist.get_world_size()).tolist(),
                         weights=serial_weights(tr))
    return out


def test_two_ranks_equal_the_single_process(tmp_path, data):
    serial = run(data, "serial-2", rollout_steps=2)
    want = serial_weights(serial)
    ranks = run_ranks(ranks_rollout, 2, data["era5"], tmp_path, timeout=300)
    for name, got in ranks[0].items():
        assert got["losses"] == pytest.approx(serial.losses, rel=1e-5), name
        assert got["weights"].keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got["weights"][k], want[k], rtol=1e-5, atol=2e-6,
                                       msg=lambda m, k=k, name=name: f"{name} {k}: {m}")


def test_benchmark_measures_each_rollout_with_and_without_checkpointing(capsys):
    from benchmarks import rollout
    rollout.main(["--rollouts", "1,2", "--steps", "1", "--warmup", "1", "--depth", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "no"), ("1", "yes"), ("2", "no"), ("2", "yes")]
    peak = {(r[0], r[1]): float(r[5]) for r in rows}
    assert peak[("2", "yes")] < peak[("1", "no")] < peak[("2", "no")]
