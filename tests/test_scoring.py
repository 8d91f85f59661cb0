"""Scoring a trained model (score.py): each metric against an independent float64 NumPy
computation, the cases whose answer is known (a perfect forecast, the climatology forecast,
persistence at lead 0, a rollout that adds one per step, a field of known spectrum, identical
and noisy fields, tiles against one whole forward), both quickstarts trained, then scored, and
the same scoring on 3 gloo ranks (one with no initial condition to roll out, tiles 3, 3 and 2)
equal to one process's."""
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import preloaded
from conftest import ROOT, file_digests, write_cosmo, write_cosmo_pair, write_era5
from distributed_harness import find_free_port, run_ranks
import score as score_command
from networks.unet import UNet, down_block, up_block
from settings.errors import ConfigError
from tasks.forecast_skill import (SkillSums, acc, initial_conditions, lead_steps_for, rollout,
                                  small_scale_ratio, units, zonal_spectrum)
from tasks.losses import latitude_weights, weighted_rmse
from tasks.volume_stats import (_shells, cross_power, field_errors, histograms, predict_tiled, spectra,
                                tile_plan, unet_halo)
from test_training import TINY_UNET, TINY_VIT, no_plots, run_dir, tb_scalars, train

H, W = 9, 16


def np_weights(h):
    """cos(latitude), rows from 90 to -90 degrees, normalised to mean 1."""
    c = np.cos(np.deg2rad(np.linspace(90.0, -90.0, h)))
    return c / c.mean()


def np_rmse(f, o):
    w = np_weights(f.shape[-2])[:, None]
    return np.sqrt((w * (f - o) ** 2).mean(axis=(-2, -1)))


def np_acc(f, o, clim):
    w = np_weights(f.shape[-2])[:, None]
    fa, oa = f - clim, o - clim
    return (w * fa * oa).sum(axis=(-2, -1)) / np.sqrt((w * fa**2).sum(axis=(-2, -1))
                                                      * (w * oa**2).sum(axis=(-2, -1)))


def fields(seed=0, shape=(3, 4, H, W)):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal(shape[1:])


# ----------------------------------------------------------------------------- forecast skill


def test_rmse_and_acc_equal_the_float64_definitions():
    f, o, clim = fields()
    w = latitude_weights(H)
    t = [torch.tensor(a, dtype=torch.float32) for a in (f, o, clim)]
    assert np.allclose(weighted_rmse(t[0], t[1], w).numpy(), np_rmse(f, o), rtol=1e-5)
    assert np.allclose(acc(*t, w).numpy(), np_acc(f, o, clim), rtol=1e-5, atol=1e-6)


def test_perfect_forecast_rmse_0_acc_1_and_climatology_acc_0():
    _, o, clim = fields(1)
    w = latitude_weights(H)
    o, clim = torch.tensor(o), torch.tensor(clim)
    assert torch.equal(weighted_rmse(o, o, w), torch.zeros(3, 4))
    assert torch.allclose(acc(o, o, clim, w), torch.ones(3, 4))
    # the climatology forecast has no anomaly: its ACC is 0 by definition (not 0/0)
    assert torch.equal(acc(clim.expand_as(o), o, clim, w), torch.zeros(3, 4))


def test_rollout_feeds_back_its_output_and_persistence_at_lead_0_is_exact():
    _, x0, clim = fields(2)
    x0, clim, w = torch.tensor(x0), torch.tensor(clim), latitude_weights(H)
    steps = list(rollout(lambda s: s + 1, x0, 5))
    assert [k for k, _ in steps] == [1, 2, 3, 4, 5]
    for k, pred in steps:
        assert torch.allclose(pred, x0 + k)
    # against a truth that stays at x0: the model's RMSE is k at lead k (weights of mean 1)
    sums = SkillSums(6, 4, W)
    sums.add("model", 0, x0, x0, clim, w)
    sums.add("persistence", 0, x0, x0, clim, w)
    for k, pred in steps:
        sums.add("model", k, pred, x0, clim, w)
    rmse, accs, _ = sums.means()
    assert np.allclose(rmse[0], np.arange(6)[:, None], atol=1e-6)
    assert np.all(rmse[1, 0] == 0) and np.allclose(accs[1, 0], 1)


def test_rmse_is_weatherbench2s_sqrt_of_the_time_mean_mse_or_by_name_the_mean_rmse():
    """Two initial times with errors 3 and 4 everywhere: WeatherBench 2's RMSE (the default) is
    sqrt((9 + 16) / 2); sqrt_before_time_avg's (3 + 4) / 2."""
    truth = torch.zeros(2, 1, H, W)
    pred = torch.tensor([3.0, 4.0]).view(2, 1, 1, 1).expand(2, 1, H, W)
    for rmse, want in ((None, np.sqrt(12.5)), ("sqrt_before_time_avg", 3.5)):
        sums = SkillSums(1, 1, W, **({"rmse": rmse} if rmse else {}))
        sums.add("model", 0, pred, truth, None, latitude_weights(H))
        assert sums.means()[0][0, 0, 0] == pytest.approx(want, rel=1e-6)


def test_zonal_spectrum_of_known_wavenumbers_and_a_smoothed_fields_ratio_falls():
    """Rows 2 cos(3 x) + 0.5 sin(7 x) + 1: power 2^2 / 2 at m = 3, 0.5^2 / 2 at m = 7, 1 at
    m = 0, nothing else; the spectrum sums to the weighted mean square. A field smoothed
    along the latitude circle keeps less of the truth's small-scale power the more it is
    smoothed; itself, all of it."""
    x = 2 * np.pi * np.arange(W) / W
    row = 2 * np.cos(3 * x) + 0.5 * np.sin(7 * x) + 1
    field = torch.tensor(np.broadcast_to(row, (1, 1, H, W)).copy())
    want = np.zeros(W // 2 + 1)
    want[[0, 3, 7]] = 1, 2.0, 0.125
    assert np.allclose(zonal_spectrum(field, torch.ones(H))[0, 0].numpy(), want, atol=1e-12)
    rng = np.random.default_rng(0)
    noise = torch.tensor(rng.standard_normal((4, 2, H, 64)))
    w = latitude_weights(H)
    power = zonal_spectrum(noise, w)
    assert torch.allclose(power.sum(-1), (w.double().view(1, 1, -1, 1) * noise**2).mean((2, 3)))
    ratios = []
    for width in (1, 3, 5, 9):
        smooth = sum(noise.roll(s, -1) for s in range(-(width // 2), width // 2 + 1)) / width
        ratios.append(small_scale_ratio(zonal_spectrum(smooth, w).numpy(), power.numpy()))
    assert np.allclose(ratios[0], 1)
    assert all(np.all(b < a) for a, b in zip(ratios, ratios[1:])), ratios
    assert np.all(ratios[1] < 0.5)


def test_lead_steps_and_initial_conditions():
    assert lead_steps_for([100], dt=1, wanted=None, n_init=None) == (40, 32, "")
    assert lead_steps_for([100], dt=2, wanted=None, n_init=None) == (20, 32, "")
    # years of 12 and 30 steps give 32 initial conditions for at most 5 lead steps (7 + 25)
    n, n_init, note = lead_steps_for([12, 30], dt=1, wanted=None, n_init=None)
    assert (n, n_init) == (5, 32) and note == ("note: the split's years give 32 initial "
                                               "conditions for at most 5 lead steps (30 h): 5 "
                                               "instead of 40")
    assert lead_steps_for([12, 30], dt=1, wanted=29, n_init=1) == (29, 1, "")
    assert lead_steps_for([3, 4], dt=1, wanted=None, n_init=None)[:2] == (1, 5)  # all there are
    # during training (skill_every) a split too short is fitted, not refused: the longest lead
    # any year gives, with the initial conditions it has
    assert lead_steps_for([12, 30], dt=1, wanted=4, n_init=8, fit=True)[:2] == (4, 8)
    assert lead_steps_for([12, 30], dt=1, wanted=27, n_init=8, fit=True)[:2] == (27, 3)
    assert lead_steps_for([12, 30], dt=1, wanted=40, n_init=8, fit=True)[:2] == (29, 1)
    with pytest.raises(ConfigError, match=r"^--lead_steps 6: the split's years give 32 initial "
                       r"conditions for at most 5 lead steps \(30 h\): give --lead_steps 5 or "
                       r"fewer, or a smaller --n_init$"):
        lead_steps_for([12, 30], dt=1, wanted=6, n_init=None)
    with pytest.raises(ConfigError, match=r"^--n_init 41: the split's years hold 40 initial "
                       r"conditions of a 6 h forecast: give --n_init 40 or fewer$"):
        lead_steps_for([12, 30], dt=1, wanted=1, n_init=41)
    starts = initial_conditions([12, 30], span=8, n=5)
    assert len(starts) == 5 and starts[0] == (0, 0) and starts[-1] == (1, 21)
    assert all(t + 8 < [12, 30][k] for k, t in starts)
    assert units("z500") == "m^2/s^2" and units("t2m") == "K" and units("tcwv") == "kg/m^2"


# ----------------------------------------------------------------------------- volume statistics


def np_shell_average(values, side):
    """Mean of ``values`` (the full L^3 FFT grid) over the modes of each shell 1..L/2."""
    k = np.fft.fftfreq(side, 1.0 / side)
    shell = np.rint(np.sqrt(k[:, None, None]**2 + k[None, :, None]**2 + k[None, None, :]**2))
    out = [values[shell == s].mean() for s in range(1, side // 2 + 1)]
    return np.array(out), np.array([(shell == s).sum() for s in range(1, side // 2 + 1)])


def test_cross_power_equals_the_full_fft_computation():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 16, 16, 16))
    fa, fb = np.fft.fftn(a - a.mean()), np.fft.fftn(b - b.mean())
    expected, modes = np_shell_average((fa * np.conj(fb)).real / 16**3, 16)
    k, p, n = cross_power(a.astype(np.float32), b.astype(np.float32))
    assert np.array_equal(k, np.arange(1, 9)) and np.array_equal(n, modes)
    assert np.allclose(p, expected, rtol=1e-5, atol=1e-9)


def test_a_field_of_known_spectrum_gives_it_back_within_cosmic_variance():
    side = 32
    rng = np.random.default_rng(4)
    k = np.fft.fftfreq(side, 1.0 / side)
    kmag = np.sqrt(k[:, None, None]**2 + k[None, :, None]**2 + k[None, None, :]**2)
    target = np.where(kmag > 0, 10.0 * np.maximum(kmag, 1.0) ** -2.0, 0.0)
    field = np.fft.ifftn(np.fft.fftn(rng.standard_normal((side,) * 3)) * np.sqrt(target)).real
    expected, modes = np_shell_average(target, side)
    _, p, _ = cross_power(field, field)
    # each shell holds modes/2 independent complex amplitudes: relative scatter sqrt(2 / modes)
    pull = (p / expected - 1) / np.sqrt(2.0 / modes)
    assert np.all(np.abs(pull) < 4), pull
    assert abs(pull.mean()) < 4 / np.sqrt(len(pull))


def test_the_synthetic_nbody_field_has_the_spectrum_its_generator_draws_it_from():
    """The N-body density channel the synthetic data generator writes (a Gaussian random field
    of the BBKS spectrum, datapipe.synthetic) measured by ``cross_power``: each shell's power is
    the generator's spectrum averaged over the shell's modes, within 4 sigma of cosmic variance
    (sigma = sqrt(2 / modes): the modes come in conjugate pairs)."""
    from datapipe import synthetic

    size = 32
    channel, _, field = next(synthetic._cosmo_fields(size, np.random.default_rng(3)))
    assert channel == "Nbody"
    k, p, n = cross_power(field, field)
    kk = 2 * np.pi * np.fft.fftfreq(size, d=synthetic._CELL_MPC)
    kz = 2 * np.pi * np.fft.rfftfreq(size, d=synthetic._CELL_MPC)
    power = synthetic._bbks_power(np.sqrt(kk[:, None, None] ** 2 + kk[None, :, None] ** 2
                                          + kz[None, None, :] ** 2))
    shell, count = _shells(size)
    grid_variance = np.sum(power * count) / size ** 3  # the generator's normalisation
    per_mode = synthetic._SIGMA_DELTA ** 2 / grid_variance * power \
        / synthetic._NBODY_LOG_SCALE ** 2
    keep = (shell >= 1) & (shell <= size // 2)
    drawn = np.bincount(shell[keep], weights=(count * per_mode)[keep],
                        minlength=size // 2 + 1)[1:] / n
    sigma = np.sqrt(2 / n)
    assert np.all(np.abs(p / drawn - 1) < 4 * sigma), (p / drawn - 1) / sigma
    assert p[0] > 10 * p[-1]  # a red spectrum, as drawn


def test_r_is_1_for_identical_fields_and_falls_as_noise_is_added():
    side = 32
    rng = np.random.default_rng(5)
    k = np.fft.fftfreq(side, 1.0 / side)
    kmag = np.sqrt(k[:, None, None]**2 + k[None, :, None]**2 + k[None, None, :]**2)
    red = np.fft.ifftn(np.fft.fftn(rng.standard_normal((side,) * 3))
                       * np.maximum(kmag, 1.0) ** -1.5).real
    same = spectra(red, red)
    assert np.allclose(same["r"], 1) and np.allclose(same["ratio"], 1)
    twice = spectra(2 * red, red)  # the ratio is the transfer function squared, as documented
    assert np.allclose(twice["ratio"], 4) and np.allclose(twice["r"], 1)
    noise = rng.standard_normal(red.shape) * red.std()
    r = [spectra(red + s * noise, red)["r"] for s in (0.1, 0.5, 2.0)]
    assert np.all(r[0] > r[1]) and np.all(r[1] > r[2])
    # white noise on a red field: the small scales (high k) are lost first
    assert r[1][0] > 0.99 and r[1][-1] < r[1][0] - 0.2 and r[2][-1] < 0.5


def test_histograms_and_field_errors():
    rng = np.random.default_rng(6)
    t = rng.standard_normal((8, 8, 8))
    p = t + 0.1 * rng.standard_normal(t.shape) + 0.5
    h = histograms(p, t, bins=20)
    width = h["centres"][1] - h["centres"][0]
    assert np.isclose(h["true"].sum() * width, 1) and np.isclose(h["pred"].sum() * width, 1)
    assert np.array_equal(histograms(t, t)["true"], histograms(t, t)["pred"])
    e = field_errors(p.astype(np.float32), t.astype(np.float32))
    assert np.isclose(e["bias"], (p - t).mean(), rtol=1e-5)
    assert np.isclose(e["rmse"], np.sqrt(((p - t) ** 2).mean()), rtol=1e-5)
    assert np.isclose(e["relative_error"], np.linalg.norm(p - t) / np.linalg.norm(t), rtol=1e-5)


def unet_of_levels(levels, seed=0):
    """networks.unet.UNet with ``levels`` levels of widths 2, 3, 4, ... (the class itself has 5
    or 6): the same layers and forward, small enough to tile a small volume."""
    torch.manual_seed(seed)
    model = UNet(in_chans=2, out_chans=3, base_width=2, max_width=2, full_scale=False)
    widths = [2 + i for i in range(levels)]
    model.levels = levels
    model.down = nn.ModuleList(down_block(c, w, 0.01) for c, w in zip([2] + widths, widths))
    model.up = nn.ModuleList(up_block(widths[i] if i == levels - 1 else 2 * widths[i], widths[i - 1])
                             for i in reversed(range(1, levels)))
    model.last = nn.ConvTranspose3d(2 * widths[0], 3, 4, stride=2, padding=1)
    for m in model.modules():  # non-zero biases: a tile that saw padding where the whole
        if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)):  # volume has data would differ
            nn.init.normal_(m.weight, 0.0, 0.3)
            nn.init.normal_(m.bias, 0.0, 0.3)
    return model.eval()


def test_tile_plan_covers_the_axis_with_aligned_windows():
    for side, tile, halo in ((48, 8, 12), (48, 16, 0), (32, 32, 96), (40, 16, 8)):
        plan = tile_plan(side, tile, halo, 4 if side != 40 else 8)
        window = min(side, tile + 2 * halo)
        assert [a for a, _, _ in plan] == list(range(0, side, tile)) and plan[-1][1] == side
        for a, b, s in plan:
            assert s % 4 == 0 and 0 <= s and s + window <= side
            assert s <= max(a - halo, 0) and s + window >= min(b + halo, side)


def test_unet_halo_is_how_far_a_tile_edge_reads():
    """Perturb one input voxel at a time: the outputs that change lie within the halo of it for
    a tile's first and last voxels, and beyond the next smaller multiple of 2^levels."""
    for levels in (2, 3):
        align, halo = 2**levels, unet_halo(levels)
        model = unet_of_levels(levels).double()
        side = 8 * align
        x = torch.randn(1, 2, side, align, align, dtype=torch.float64)
        with torch.no_grad():
            base = model(x)
            reach = 0
            for p in range(side // 2, side // 2 + align):  # every residue of p
                y = x.clone()
                y[0, :, p] += 1.0
                changed = ((model(y) - base).abs().amax(dim=(0, 1, 3, 4)) > 1e-12).nonzero().flatten()
                reach = max([reach] + [p - int(j) for j in changed if j % align == 0]
                            + [int(j) - p for j in changed if j % align == align - 1])
        assert halo - align < reach <= halo, (levels, reach, halo)


def test_tiles_with_the_unet_halo_equal_one_whole_forward():
    model = unet_of_levels(2)
    x = torch.randn(1, 2, 32, 32, 32)
    halo = unet_halo(2)
    with torch.no_grad():
        whole = model(x)
        tiled = predict_tiled(model, x, tile=8, halo=halo, align=4, batch=16)
        assert torch.allclose(tiled, whole, atol=1e-5, rtol=0), (tiled - whole).abs().max()
        short = predict_tiled(model, x, tile=8, halo=halo - 4, align=4, batch=16)
        assert (short - whole).abs().max() > 1e-4  # the halo is needed: the seams show without it


def test_the_quickstart_unet_halo_and_a_volume_smaller_than_a_window():
    assert unet_halo(2) == 8 and unet_halo(5) == 64 and unet_halo(6) == 128
    torch.manual_seed(0)
    model = UNet(in_chans=4, out_chans=5, base_width=2, max_width=4, full_scale=False).eval()
    x = torch.randn(1, 4, 32, 32, 32)
    with torch.no_grad():
        assert torch.equal(predict_tiled(model, x, tile=32, halo=64, align=32), model(x))


# ----------------------------------------------------------------------------- score.py


def score(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return preloaded.run([sys.executable, "score.py", *args], cwd=ROOT, capture_output=True,
                         text=True, env=env)


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    """The tiny ViT trained for 4 steps on 16-step years: its run directory."""
    tmp = tmp_path_factory.mktemp("vit")
    root = write_era5(str(tmp / "era5"), steps=16)
    exp = str(tmp / "exp")
    train(TINY_VIT + ["--data_root", root, "--expdir", exp, "--num_iters", "4"])
    return run_dir(exp)


@pytest.fixture(scope="module")
def unet_run(tmp_path_factory):
    """The tiny U-Net trained for 2 steps on 32^3 volumes: its checkpoint, beside a 64^3 volume
    ``big.h5`` in its data_root (8 tiles of the 5-level U-Net's 32^3)."""
    tmp = tmp_path_factory.mktemp("unet")
    root = write_cosmo_pair(tmp / "cosmo", side=32)
    write_cosmo(os.path.join(root, "big.h5"), side=64, seed=2)
    exp = str(tmp / "exp")
    train(TINY_UNET + ["--data_root", root, "--expdir", exp, "--num_iters", "2", "--Nsamples", "8",
                       "--Nsamples_val", "2", "--num_data_workers", "0"])
    return os.path.join(run_dir(exp), "checkpoints", "ckpt_00000002.pt")


def test_skill_during_training_is_score_pys_for_the_same_options(tmp_path, monkeypatch):
    """--skill_every 2 over 3 epochs: after the second epoch's validation (and only then) the
    log gives the skill's summary and TensorBoard the model's RMSE and ACC of every variable at
    the last lead time of 2-step rollouts from 8 initial conditions, at that step; they are
    score.py's numbers for its checkpoint with the same options."""
    root = write_era5(str(tmp_path / "era5"), steps=16)
    exp = str(tmp_path / "exp")
    r = train(TINY_VIT + ["--data_root", root, "--expdir", exp, "--num_epochs", "3",
                          "--skill_every", "2", "--skill_lead_steps", "2",
                          "--checkpoint_every", "1", "--checkpoint_keep", "20"])
    assert r.stdout.count("Forecast skill on valid: 8 initial conditions, 2 lead steps (12 h)") == 1
    d = run_dir(exp)
    events = tb_scalars(os.path.join(d, "tensorboard"))
    tags = [t for t in events.Tags()["scalars"] if t.startswith("Skill/")]
    assert len(tags) == 2 * 20 and "Skill/ACC(t850) at 12 h" in tags
    points = events.Scalars("Skill/RMSE(z500) at 12 h")
    steps_per_epoch = int(re.search(r"(\d+) steps per epoch", r.stdout).group(1))
    assert [p.step for p in points] == [2 * steps_per_epoch]
    ckpt = os.path.join(d, "checkpoints", f"ckpt_{2 * steps_per_epoch:08d}.pt")
    monkeypatch.setattr("observe.score_report.draw", no_plots)  # the numbers, not the plots
    score_command.main(["--run", ckpt, "--lead_steps", "2", "--n_init", "8", "--out",
                        str(tmp_path / "s")])
    rows = {(x["variable"], x["lead_step"]): x for x in read_rows(str(tmp_path / "s" / "scores.csv"))
            if x["forecast"] == "model"}
    for tag in tags:
        metric, variable = re.match(r"Skill/(RMSE|ACC)\((\w+)\) at 12 h", tag).groups()
        want = float(rows[(variable, "2")][metric.lower()])
        assert events.Scalars(tag)[0].value == pytest.approx(want, rel=1e-6, abs=1e-7), tag


def test_skill_during_training_on_two_ranks_is_one_process_score(tmp_path, monkeypatch):
    """2 DDP ranks (started as srun starts them) each roll out their share of the 8 initial
    conditions; the sums over both are the numbers one process's score.py gives."""
    root = write_era5(str(tmp_path / "era5"), steps=16)
    exp = str(tmp_path / "exp")
    args = TINY_VIT + ["--data_root", root, "--expdir", exp, "--num_epochs", "1",
                       "--skill_every", "1", "--skill_lead_steps", "3"]
    port = find_free_port()
    procs = [preloaded.Popen([sys.executable, "train.py", *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, RANK=str(r), WORLD_SIZE="2",
                                      LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert "Scoring 8 initial conditions of" in outs[0][0] and ", 4 of them on rank 0 of 2" in \
        outs[0][0]
    d = run_dir(exp, ws=2)
    events = tb_scalars(os.path.join(d, "tensorboard"))
    monkeypatch.setattr("observe.score_report.draw", no_plots)  # the numbers, not the plots
    score_command.main(["--run", d, "--lead_steps", "3", "--n_init", "8"])
    rows = {(x["variable"], x["lead_step"]): x for x in
            read_rows(os.path.join(d, "score", "scores.csv")) if x["forecast"] == "model"}
    for variable in ("z500", "t850", "u10m"):
        for metric in ("RMSE", "ACC"):
            got = events.Scalars(f"Skill/{metric}({variable}) at 18 h")
            assert len(got) == 1 and got[0].value == pytest.approx(
                float(rows[(variable, "3")][metric.lower()]), rel=1e-6, abs=1e-7)


def test_skill_during_training_is_refused_where_a_rank_cannot_roll_out_alone():
    from settings.parse import build_config
    for extra, says in (({"fsdp": True}, "a model sharded over ranks"),
                        ({"tensor_parallel": 2}, "a model sharded over ranks"),
                        ({"data_loader_config": "synthetic"}, "synthetic has none")):
        with pytest.raises(ConfigError, match=says):
            build_config(f"{ROOT}/config/ViT.yaml", "quickstart", {"skill_every": 1, **extra})


def test_vit_run_trained_then_scored(vit_run, tmp_path, capsys):
    d = vit_run
    r = score(["--run", d, "--lead_steps", "6", "--n_init", "3", "--batch_size", "2"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = os.path.join(d, "score")
    plots = ["acc_all", "acc_headline", "p_ratio_all", "p_ratio_headline", "rmse_all",
             "rmse_headline", "spectra_headline"]
    for name in ("scores.csv", "spectra.csv", "scores.json", *(f"{p}.png" for p in plots)):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    events = tb_scalars(os.path.join(out, "tensorboard"))  # the plots also as images
    assert sorted(events.Tags()["images"]) == [f"Plots/{p}" for p in plots]
    assert "Skill/P_ratio(z500)/model" in events.Tags()["scalars"]
    image = events.Images("Plots/rmse_headline")[0]
    assert image.encoded_image_string == open(os.path.join(out, "rmse_headline.png"), "rb").read()
    assert (image.width, image.height) > (300, 200)
    assert "Skill/RMSE(z500)/persistence" in events.Tags()["scalars"]
    assert "Forecast skill on valid: 3 initial conditions, 6 lead steps (36 h)" in r.stdout
    rows = read_rows(os.path.join(out, "scores.csv"))
    for variable in ("z500", "u10m"):
        pers = [float(x["rmse"]) for x in rows if x["forecast"] == "persistence"
                and x["variable"] == variable]
        assert len(pers) == 7 and pers[0] == 0 and all(b > a for a, b in zip(pers, pers[1:])), pers
        model0 = [x for x in rows if x["forecast"] == "model" and x["variable"] == variable][0]
        assert float(model0["rmse"]) == 0 and float(model0["acc"]) == pytest.approx(1)
        assert float(model0["p_ratio"]) == pytest.approx(1)
    saved = json.load(open(os.path.join(out, "scores.json")))
    meta = saved["meta"]
    assert meta["forecasts"] == ["model", "persistence", "climatology"] and meta["step"] == 4
    assert meta["rmse"] == "sqrt_after_time_avg" and meta["p_ratio_wavenumbers"] == [9, 16]
    # spectra at leads 0, 1, 3 (half), 4 (a day) and 6, of 3 forecasts and the truth, m = 0..16
    spectra = read_rows(os.path.join(out, "spectra.csv"))
    assert len(spectra) == len(saved["spectra"]) == 4 * 20 * 5 * 17
    assert {x["lead_step"] for x in spectra} == {"0", "1", "3", "4", "6"}
    assert spectra[0] == {"forecast": "model", "variable": "u10m", "power_units": "(m/s)^2",
                          "lead_step": "0", "lead_hours": "0", "wavenumber": "0",
                          "power": spectra[0]["power"]}

    # an existing output is refused, and left as it was
    before = hashlib.md5(open(os.path.join(out, "scores.csv"), "rb").read()).hexdigest()
    for argv, fragment in ((["--run", str(tmp_path / "missing")], "no such run directory"),
                           (["--run", d], "exists already"),
                           (["--run", d, "--n_init", "0"], "--n_init: 0 is below 1: give 1 or more")):
        with pytest.raises(SystemExit) as e:
            score_command.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert fragment in err, err
    assert hashlib.md5(open(os.path.join(out, "scores.csv"), "rb").read()).hexdigest() == before
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")]


def test_unet_run_trained_then_scored(unet_run, tmp_path, capsys, monkeypatch):
    ckpt = unet_run
    out = str(tmp_path / "scores")
    r = score(["--run", ckpt, "--out", out])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name in ("scores.csv", "scores.json", "power_spectra.png", "spectrum_ratio.png",
                 "cross_correlation.png", "pdfs.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    rows = read_rows(os.path.join(out, "scores.csv"))
    assert {x["channel"] for x in rows} == {"log_rho", "log_T", "vx", "vy", "vz"}
    assert all(len([x for x in rows if x["channel"] == c]) == 16 for c in ("log_rho", "vz"))
    assert all(-1 <= float(x["r"]) <= 1 and float(x["p_ratio"]) > 0 for x in rows)
    assert "Volume statistics of" in r.stdout and "r(k)" in r.stdout
    assert sorted(tb_scalars(os.path.join(out, "tensorboard")).Tags()["images"]) == [
        "Plots/cross_correlation", "Plots/pdfs", "Plots/power_spectra", "Plots/spectrum_ratio"]
    pdfs = read_rows(os.path.join(out, "pdfs.csv"))  # the PDFs' 60 bins of each channel
    assert len(pdfs) == 5 * 60 and list(pdfs[0]) == ["channel", "value", "density_true",
                                                     "density_pred"]
    assert json.load(open(os.path.join(out, "scores.json")))["pdfs"][0]["channel"] == "log_rho"

    # the same weights as a DCP directory (what an FSDP run writes) score the same
    state = torch.load(ckpt, weights_only=True)
    sharded = str(tmp_path / "ckpt_00000003.dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that no process group is running
        dcp.save({"model": state["model"], "optimizer": state["optimizer"]}, checkpoint_id=sharded,
                 no_dist=True)
    torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer")},
               os.path.join(sharded, "train_state.pt"))
    monkeypatch.setattr("observe.score_report.draw", no_plots)  # the numbers are compared
    score_command.main(["--run", sharded, "--out", str(tmp_path / "scores_dcp")])
    assert "Scores written to" in capsys.readouterr().out
    again = read_rows(str(tmp_path / "scores_dcp" / "scores.csv"))
    assert again == rows


VIT_OPTIONS = ["--lead_steps", "6", "--n_init", "2", "--batch_size", "2"]
UNET_OPTIONS = ["--split", "big.h5", "--tile", "32", "--halo", "0"]


def rank_scores(vit, unet, out):
    """On each rank: both runs scored into ``out``/vit and ``out``/unet; the ViT again into the
    existing ``out``/vit; and a run that rank 1 alone cannot find (as on a node that does not
    see the file system). The exit code (None: it returned) and what went to stderr, of each."""
    missing = vit + "_missing" if dist.get_rank() == 1 else vit
    with mock.patch("observe.score_report.draw", no_plots):
        return [_code(score_command.main, argv) for argv in (
            ["--run", vit, "--out", os.path.join(out, "vit"), *VIT_OPTIONS],
            ["--run", unet, "--out", os.path.join(out, "unet"), *UNET_OPTIONS],
            ["--run", vit, "--out", os.path.join(out, "vit"), *VIT_OPTIONS],
            ["--run", missing, "--out", os.path.join(out, "missing"), *VIT_OPTIONS])]


def _code(main, argv):
    """(exit code of ``main(argv)``, None when it returns; its stderr)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            main(argv)
        return None, err.getvalue()
    except SystemExit as e:
        return e.code, err.getvalue()


def test_scores_over_three_ranks_equal_one_process(vit_run, unet_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("observe.score_report.draw", no_plots)
    one, two = tmp_path / "one", tmp_path / "two"
    score_command.main(["--run", vit_run, "--out", str(one / "vit"), *VIT_OPTIONS])
    score_command.main(["--run", unet_run, "--out", str(one / "unet"), *UNET_OPTIONS])
    assert "8 tiles" in capsys.readouterr().out
    # 2 initial conditions: one on rank 0, one on rank 1, none on rank 2; 8 tiles: 3, 3 and 2.
    # The third scoring finds its output existing on rank 0 only, the fourth no run on rank 1
    # only: every rank stops with the code of the one that refused, none waits, and rank 0 says
    # why, once.
    ranks = run_ranks(rank_scores, 3, vit_run, unet_run, str(two), timeout=120, pg_timeout=60)
    assert [[code for code, _ in rank] for rank in ranks] == [[None, None, 2, 2]] * 3, ranks
    assert [err for _, err in ranks[1] + ranks[2]] == [""] * 8, ranks[1:]
    exists, missing = ranks[0][2][1], ranks[0][3][1]
    assert exists.startswith("error: ") and "exists already" in exists and exists.count("\n") == 1
    assert missing.startswith(f"error: rank 1: --run {vit_run}_missing: no such run") \
        and missing.count("\n") == 1, missing
    for problem, keys, tol in (("vit", ("rmse", "acc"), 1e-6),
                               ("unet", ("p_true", "p_pred", "p_ratio", "r"), 1e-5)):
        a, b = read_rows(one / problem / "scores.csv"), read_rows(two / problem / "scores.csv")
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            for key in keys:
                if x[key] or y[key]:
                    assert float(y[key]) == pytest.approx(float(x[key]), rel=tol, abs=1e-12), (problem, key, x, y)
        meta = json.load(open(two / problem / "scores.json"))["meta"]
        assert meta["ranks"] == 3
    assert sorted(os.listdir(two)) == ["unet", "vit"]  # nothing else, nothing left half-written


# ----------------------------------------------------------------------------- bad input


def refusal(capsys, argv, run):
    """score.py's one stderr line for ``argv``, checked to be an exit code 2 that left ``run``
    as it was."""
    before = file_digests(run)
    with pytest.raises(SystemExit) as e:
        score_command.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, (e.value, err)
    assert file_digests(run) == before
    return err


def test_a_split_without_year_files_is_refused_with_the_splits_there_are(vit_run, tmp_path,
                                                                          capsys):
    out = tmp_path / "s"
    err = refusal(capsys, ["--run", vit_run, "--split", "tst", "--out", str(out)], vit_run)
    assert err.startswith("error: --split tst: ") and "choose one of valid, train\n" in err, err
    assert not out.exists()


def test_options_of_the_other_models_scoring_are_refused(vit_run, unet_run, tmp_path, capsys):
    """Given on the command line only: the runs score without them (the tests above), though
    each option has a default."""
    unet_dir = os.path.dirname(os.path.dirname(unet_run))
    out = tmp_path / "s"
    for run, option, value, model in ((unet_run, "--lead_steps", "4", "ViT"),
                                      (unet_run, "--n_init", "4", "ViT"),
                                      (vit_run, "--tile", "32", "U-Net"),
                                      (vit_run, "--halo", "0", "U-Net")):
        err = refusal(capsys, ["--run", run, option, value, "--out", str(out)],
                      unet_dir if run == unet_run else vit_run)
        assert err.startswith(f"error: {option} {value} is an option of the {model}'s scoring"), err
        assert f"drop {option}" in err, err
    assert not out.exists()


def test_a_tile_or_halo_off_the_grid_gets_valid_distinct_choices(unet_run, tmp_path, capsys):
    for name, value, choices in (("tile", 30, "choose 32\n"), ("halo", 10, "choose 0 or 32\n")):
        err = refusal(capsys, ["--run", unet_run, f"--{name}", str(value), "--out",
                               str(tmp_path / "s")], os.path.dirname(os.path.dirname(unet_run)))
        assert err.startswith(f"error: {name}={value} must be a multiple of 32") and \
            err.endswith(choices), err
    plans = {"side": lambda v: tile_plan(v, 32, 0, 32), "tile": lambda v: tile_plan(128, v, 0, 32),
             "halo": lambda v: tile_plan(128, 32, v, 32)}
    for value in (v for v in range(1, 130) if v % 32):  # every choice offered is accepted
        for name, plan in plans.items():
            with pytest.raises(ConfigError) as e:
                plan(value)
            near = [int(v) for v in re.search(r"choose (.*)", str(e.value)).group(1).split(" or ")]
            assert len(set(near)) == len(near) > 0, str(e.value)  # and none twice
            for v in near:
                plan(v)


def test_the_runs_checkpoints_directory_scores_the_run(vit_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("observe.score_report.draw", no_plots)
    run = str(tmp_path / "run")
    shutil.copytree(vit_run, run, ignore=shutil.ignore_patterns("score"))
    score_command.main(["--run", os.path.join(run, "checkpoints") + os.sep, *VIT_OPTIONS])
    assert "Scores written to" in capsys.readouterr().out
    meta = json.load(open(os.path.join(run, "score", "scores.json")))["meta"]
    assert meta["checkpoint"] == os.path.join(run, "checkpoints", "ckpt_00000004.pt")


def test_a_damaged_config_yaml_is_named_with_the_fix(vit_run, tmp_path, capsys):
    run = str(tmp_path / "run")
    shutil.copytree(vit_run, run, ignore=shutil.ignore_patterns("score"))
    path = os.path.join(run, "config.yaml")
    ckpt = os.path.join(run, "checkpoints", "ckpt_00000004.pt")
    for text, says in (("quickstart: [1\n", "is not valid YAML (line 2, column 1: "),
                       ("", "does not hold one config"),
                       ("a:\n  lr: 1\nb:\n  lr: 2\n", "does not hold one config"),
                       (b"\xff\xfe\x00", "cannot be read ("),
                       ("quickstart:\n  lr: abc\n", ": lr='abc' is not a number")):
        with open(path, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
        for given in (run, ckpt):
            err = refusal(capsys, ["--run", given, "--out", str(tmp_path / "s")], run)
            assert err.startswith(f"error: {path}, the run's config") and says in err, err
            assert "--yaml_config" not in err, err
            if "lr=" not in says:
                assert err.endswith("restore it, or move it out of the run directory to score "
                                    "with the config saved in the checkpoint\n"), err
    assert not (tmp_path / "s").exists()


def test_one_process_refuses_a_missing_run_at_once_and_ranks_refuse_it_together(tmp_path,
                                                                               monkeypatch):
    """One process refuses a --run that does not exist while reading its options; the ranks of a
    job leave it to the check they agree on after joining (the path may exist on some nodes)."""
    missing = str(tmp_path / "missing")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        score_command.read_command_line(["--run", missing])
    assert e.value.code == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert score_command.read_command_line(["--run", missing]).run == missing
    with pytest.raises(score_command.ConfigError, match="no such run directory"):
        score_command.find_checkpoint(missing)


def test_a_box_off_the_unets_grid_is_cut_and_the_note_names_the_spectra(unet_run, tmp_path,
                                                                       monkeypatch, capsys):
    """A 40^3 box for a 5-level U-Net (2^5 = 32): its first 32^3 voxels are scored, and the note
    says that the cut box, no longer periodic, gains power at high k."""
    monkeypatch.setattr("observe.score_report.draw", no_plots)
    root = write_cosmo_pair(tmp_path / "odd", side=40)
    out = str(tmp_path / "scores")
    score_command.main(["--run", unet_run, "--data_root", root, "--out", out])
    printed = capsys.readouterr().out
    assert "note: the box side 40 is not a multiple of 2^levels=32: the first 32^3 voxels are " \
           "scored; the cut box is not periodic, so its power spectra gain power at high k " \
           "from the cut edges" in printed, printed[-2000:]
    assert json.load(open(os.path.join(out, "scores.json")))["meta"]


def test_a_crop_of_fewer_rows_than_the_data_is_noted_for_its_latitude_weights(vit_run, tmp_path,
                                                                             monkeypatch, capsys):
    """img_size keeps the first 16 rows: of 17-row fields (the tutorial's crop, which drops the
    south pole's row) nothing is said; of 24-row fields the note says that the weights take the
    kept rows to run from pole to pole. The summary's ACC is named as the model's."""
    monkeypatch.setattr("observe.score_report.draw", no_plots)
    for rows, noted in ((17, False), (24, True)):
        root = write_era5(str(tmp_path / f"era5_{rows}"), years={"valid": [2018]}, steps=8, h=rows)
        out = str(tmp_path / f"scores_{rows}")
        score_command.main(["--run", vit_run, "--data_root", root, "--out", out,
                            "--lead_steps", "2", "--n_init", "2"])
        printed = capsys.readouterr().out
        note = (f"note: the data's fields have {rows} rows and img_size keeps the first 16; the "
                f"latitude weights take those rows to run from pole to pole")
        assert (note in printed) == noted, printed[-2000:]
        notes = json.load(open(os.path.join(out, "scores.json")))["notes"]
        assert any(n.startswith(note) for n in notes) == noted, notes
        assert re.search(r"z500 RMSE \(m\^2/s\^2\), model / persistence / climatology: 6 h "
                         r"\S+ / \S+ / \S+, model ACC -?[01]\.\d{3}", printed), printed[-2000:]


def test_without_matplotlib_the_tables_are_written_and_one_line_says_the_plots_were_skipped(
        vit_run, tmp_path, monkeypatch, capsys):
    """In this process, with ``import matplotlib`` failing as where it is not installed
    (``sys.modules["matplotlib"] = None``, whether or not it was loaded before)."""
    out = str(tmp_path / "s")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    score_command.main(["--run", vit_run, "--out", out, *VIT_OPTIONS])
    printed = capsys.readouterr()
    line = "note: matplotlib is not installed, so the plots were skipped: pip install matplotlib"
    assert printed.out.count(line) == 1 and "error" not in printed.err, printed
    assert sorted(os.listdir(out)) == ["scores.csv", "scores.json", "spectra.csv", "tensorboard"]
    assert line in json.load(open(os.path.join(out, "scores.json")))["notes"]
    assert "Skill/RMSE(z500)/model" in tb_scalars(os.path.join(out, "tensorboard")).Tags()["scalars"]


def test_plots_name_their_checkpoint_and_initial_conditions(vit_run, unet_run, tmp_path,
                                                            monkeypatch):
    """ACC and P ratio are drawn without climatology's flat lines, lead times ticked every 24 h;
    the U-Net's spectrum ratio on a log axis, its P(k) in units."""
    drawn = {}

    def record(figure, path, subtitle=""):
        drawn[figure.name] = (figure, subtitle)
        return no_plots(figure, path)

    monkeypatch.setattr("observe.score_report.draw", record)
    score_command.main(["--run", vit_run, "--out", str(tmp_path / "vit"), *VIT_OPTIONS])
    acc_panel = drawn["acc_headline"][0].panels[0]
    assert [label for label, _, _ in acc_panel.series] == ["model", "persistence"]
    assert acc_panel.xstep == 24 and drawn["rmse_all"][0].panels[0].xstep == 24
    assert [label for label, _, _ in drawn["rmse_all"][0].panels[0].series] == [
        "model", "persistence", "climatology"]
    assert drawn["p_ratio_all"][0].panels[0].logy
    assert drawn["acc_all"][1] == "ckpt_00000004.pt (step 4), 2 initial conditions"
    spectra = drawn["spectra_headline"][0].panels[0]
    assert spectra.ylabel == "P(m) ((m^2/s^2)^2)" and [s[0] for s in spectra.series] == [
        "truth 36 h", "persistence 36 h", "model 6 h", "model 18 h", "model 24 h", "model 36 h"]
    score_command.main(["--run", unet_run, "--out", str(tmp_path / "unet"), *UNET_OPTIONS])
    assert drawn["spectrum_ratio"][0].panels[0].logy
    assert drawn["power_spectra"][0].panels[0].ylabel == "P(k) ((stored units)^2 voxel^3)"
    assert drawn["pdfs"][1] == "ckpt_00000002.pt (step 2)"


def test_a_lead_or_initial_conditions_the_split_cannot_give_are_refused_naming_the_most(
        vit_run, tmp_path, capsys):
    """16 steps a year: 15 initial conditions of one step; 3 of them for up to 13 steps."""
    out = tmp_path / "s"
    for options, says in (
            (["--lead_steps", "500", "--n_init", "3"], "--lead_steps 500: the split's years give 3 "
             "initial conditions for at most 13 lead steps (78 h): give --lead_steps 13 or fewer, "
             "or a smaller --n_init\n"),
            (["--lead_steps", "14", "--n_init", "3"], "--lead_steps 14: "),
            (["--n_init", "16"], "--n_init 16: the split's years hold 15 initial conditions of a "
             "6 h forecast: give --n_init 15 or fewer\n")):
        err = refusal(capsys, ["--run", vit_run, *options, "--out", str(out)], vit_run)
        assert err.startswith("error: " + says), err
    assert not out.exists()


def test_a_checkpoint_of_the_other_model_is_refused_by_name(vit_run, unet_run, tmp_path, capsys):
    for run, ckpt, says in ((vit_run, unet_run, "a U-Net checkpoint given to a ViT run"),
                            (os.path.dirname(os.path.dirname(unet_run)),
                             os.path.join(vit_run, "checkpoints", "ckpt_00000004.pt"),
                             "a ViT checkpoint given to a U-Net run")):
        other = tmp_path / says.split()[1]  # a copy of the run, holding the other's checkpoint
        shutil.copytree(run, other, ignore=shutil.ignore_patterns("score", "checkpoints"))
        (other / "checkpoints").mkdir()
        shutil.copy(ckpt, other / "checkpoints")
        err = refusal(capsys, ["--run", str(other), "--out", str(tmp_path / "s")], str(other))
        assert err == (f"error: {other / 'checkpoints' / os.path.basename(ckpt)} is {says}: "
                       f"score it with its own run directory\n"), err
