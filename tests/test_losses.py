import math

import numpy as np
import pytest
import torch

from tasks.cosmo import L1Rho
from tasks.era5 import RelativeL2, WeightedRelativeL2, loss_weights
from tasks.losses import latitude_weights, weighted_rmse
from engine.optimizer import build_scheduler, check_end, describe, lr_at, peak_lr


def test_weighted_rmse_by_hand():
    h, w = 5, 4
    lat = np.array([90, 45, 0, -45, -90], dtype=float)
    cosl = np.cos(np.deg2rad(lat))
    wts = h * cosl / cosl.sum()
    np.testing.assert_allclose(latitude_weights(h).numpy(), wts, rtol=1e-6)
    rng = np.random.default_rng(0)
    p, t = rng.standard_normal((2, 3, h, w)), rng.standard_normal((2, 3, h, w))
    expect = np.zeros((2, 3))
    for b in range(2):
        for c in range(3):
            acc = 0.0
            for j in range(h):
                for i in range(w):
                    acc += wts[j] * (p[b, c, j, i] - t[b, c, j, i]) ** 2
            expect[b, c] = math.sqrt(acc / (h * w))
    got = weighted_rmse(torch.tensor(p), torch.tensor(t), latitude_weights(h)).numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-5)
    # a pole-only error counts for nothing
    p2 = t.copy()
    p2[:, :, 0] += 1
    assert np.allclose(weighted_rmse(torch.tensor(p2), torch.tensor(t), latitude_weights(h)), 0, atol=1e-6)


def test_relative_l2_per_sample():
    t = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    p = torch.tensor([[3.0, 4.0 + 5.0], [0.0, 0.0]])
    np.testing.assert_allclose(RelativeL2()(p, t).numpy(), [1.0, 1.0])


def test_l1_rho():
    p = torch.zeros(2, 5, 2, 2, 2)
    t = torch.full((2, 5, 2, 2, 2), 0.1)
    assert torch.allclose(L1Rho()(p, t), torch.full((2,), 0.1))
    extra = abs(1 - math.exp(1.4))
    assert torch.allclose(L1Rho(0.5)(p, t), torch.full((2,), 0.1 + 0.5 * extra))


WEIGHTED = WeightedRelativeL2(loss_weights(("t850", "z500"), 7, True, True, {"z500": 3.0}))


@pytest.mark.parametrize("loss", [RelativeL2(), L1Rho(), L1Rho(0.3), WEIGHTED],
                         ids=["relative_l2", "l1", "l1_rho", "weighted_relative_l2"])
def test_partial_sums_of_bands_add_up(loss):
    """Partial sums of row bands of different heights, added, finish to the loss of the whole
    sample, and their gradient is the whole sample's (what the sharded model relies on)."""
    g = torch.Generator().manual_seed(0)
    p = (0.1 * torch.randn(3, 2, 7, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    t = 0.1 * torch.randn(3, 2, 7, 4, generator=g, dtype=torch.float64)
    whole = loss(p, t)
    (g_whole,) = torch.autograd.grad(whole.sum(), p)
    bands = [(0, 3), (3, 5), (5, 7)]
    sums = sum(loss.partial_sums(p[..., a:b, :], t[..., a:b, :], (a, b)) for a, b in bands)
    assert sums.shape[0] == 3 and sums.dtype == torch.float64
    banded = loss.finish(sums)
    (g_banded,) = torch.autograd.grad(banded.sum(), p)
    torch.testing.assert_close(banded, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_banded, g_whole, rtol=1e-12, atol=1e-15)
    # one band alone is not the whole sample's loss
    assert not torch.allclose(loss.finish(loss.partial_sums(p[..., :3, :], t[..., :3, :], (0, 3))),
                              whole)


def test_partial_sums_in_float32_for_bf16():
    p = torch.randn(2, 3, 4, 4).to(torch.bfloat16)
    t = torch.randn(2, 3, 4, 4)
    for loss in (RelativeL2(), L1Rho(0.1)):
        assert loss.partial_sums(p, t).dtype == torch.float32
        torch.testing.assert_close(loss(p, t), loss(p.float(), t), rtol=1e-6, atol=0)


def test_lr_schedule_values():
    assert peak_lr(1e-3, 256, 64, "none") == 1e-3
    assert peak_lr(1e-3, 256, 64, "linear") == pytest.approx(4e-3)
    assert peak_lr(1e-3, 256, 64, "sqrt") == pytest.approx(2e-3)
    # the run header says which peak --lr led to (the *_opt configs scale it by sqrt)
    assert describe(1e-3, 2e-3, 256, 64, "sqrt", 10, 0.0) == (
        "Learning rate: peak 0.002 = lr 0.001 scaled (sqrt) from batch 64 to 256; 10 warm-up "
        "steps, then a cosine to 0")
    assert describe(1e-3, 1e-3, 64, 64, "sqrt", 0, 1e-5).startswith("Learning rate: peak 0.001;")
    # warm-up 4 steps, then cosine to end_lr over 8 more
    vals = [lr_at(s, 1.0, 0.1, 4, 12) for s in range(13)]
    assert vals[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert vals[4] == pytest.approx(1.0)
    assert vals[8] == pytest.approx(0.55)  # half way: end + (peak - end) / 2
    assert vals[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(vals[4:], vals[5:]))
    # the torch scheduler follows the same numbers
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    sched = build_scheduler(opt, 2.0, 0.0, 3, 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, 2.0, 0.0, 3, 10) for s in range(10)])


def test_an_end_lr_above_the_peak_is_refused_before_the_run_starts(tmp_path):
    from conftest import ROOT
    from engine.runtime import setup_runtime
    from settings.errors import ConfigError
    from settings.parse import build_config

    check_end(1e-3, 1e-3, 64, 16, "none")  # a flat schedule: allowed
    with pytest.raises(ConfigError, match=r"end_lr=0.003 is above the peak learning rate 0.002 "
                       r"\(lr 0.001 scaled \(sqrt\) to global batch 64\): .* set --end_lr below"):
        check_end(1e-3, 3e-3, 64, 16, "sqrt")
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "short",
                       {"end_lr": "1", "expdir": str(tmp_path / "logs")})
    with pytest.raises(ConfigError, match="end_lr=1 is above the peak learning rate"):
        setup_runtime(cfg)
    assert not (tmp_path / "logs").exists()


def test_loss_weights_as_graphcast_and_weatherbench_weigh():
    """Per channel: the variable's weight times its pressure level over the levels' mean
    (surface variables 1); per row: the area of its cells (mean 1)."""
    w = loss_weights(("t2m", "t850", "z500", "z50"), 5, True, True, {"t2m": 2.0, "z500": 0.5})
    mean_level = (850 + 500 + 50) / 3
    per_channel = [2.0, 850 / mean_level, 0.5 * 500 / mean_level, 50 / mean_level]
    expect = torch.tensor(per_channel).view(4, 1, 1) * latitude_weights(5).view(1, 5, 1)
    torch.testing.assert_close(w, expect)
    assert torch.equal(loss_weights(("t2m", "z500"), 3, False, False, {}), torch.ones(2, 3, 1))


def test_the_weighted_loss_by_hand_and_unweighted_as_the_tutorials():
    t = torch.tensor([[[[3.0], [0.0]], [[0.0], [4.0]]]])  # (1 sample, 2 channels, 2 rows, 1 col)
    p = torch.tensor([[[[3.0], [1.0]], [[2.0], [4.0]]]])
    w = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]])  # (C, H, 1)
    # errors: (0, 1) channel 0, (2, 0) channel 1: sum w e^2 = 2*1 + 3*4 = 14; sum w t^2 = 9 + 64
    torch.testing.assert_close(WeightedRelativeL2(w)(p, t), torch.tensor([math.sqrt(14 / 73)]))
    g = torch.Generator().manual_seed(1)
    p, t = torch.randn(3, 4, 6, 5, generator=g), torch.randn(3, 4, 6, 5, generator=g)
    torch.testing.assert_close(WeightedRelativeL2(torch.ones(4, 6, 1))(p, t), RelativeL2()(p, t))


def test_a_run_names_its_loss_and_trains_on_the_weighted_one(tmp_path, era5_root):
    """Off by default (the tutorial's loss, as before); each weight named in the log when on,
    and the run's loss is the weighted one."""
    import re

    from test_training import TINY_VIT, train

    def run(*extra):
        out = train(["--data_root", era5_root, "--expdir", str(tmp_path), "--num_iters", "2",
                     *TINY_VIT, *extra]).stdout
        return re.search(r"Loss: (.*)", out).group(1), re.findall(r"Avg val loss=([0-9.e+-]+)", out)

    name, plain = run()
    assert name == "relative L2, unweighted (the tutorial's)"
    name, weighted = run("--loss_latitude_weights", "true", "--loss_level_weights", "true",
                         "--loss_variable_weights", "t2m=2,z500=0.5")
    assert name == "relative L2, weighted by latitude (area), pressure level, variable"
    assert weighted and weighted != plain
