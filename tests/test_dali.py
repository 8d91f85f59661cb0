"""DALI loaders on CPU pipelines (device_id=None): the same batches as the PyTorch loaders,
rotations with vector channels, sharding, resume, the missing-DALI message, and training runs."""
import builtins
import os
import platform

import numpy as np
import pytest
import torch

from conftest import ROOT, write_cosmo_pair, write_era5
from test_training import TINY_UNET, TINY_VIT, baseline_and_val, train
from utils.config import build_config
from utils.data_loader import build_loaders
from utils.errors import ConfigError
from utils.rotations import ROTATIONS, matrix

CPU = torch.device("cpu")


@pytest.fixture
def dali():
    return pytest.importorskip("nvidia.dali")


def unet_cfg(root, mode, workers=0, **kw):
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "quickstart",
                       {"data_root": root, "Nsamples": "12", "Nsamples_val": "6",
                        "data_loader_config": mode, "num_data_workers": str(workers), **kw})
    cfg.data_size = 8  # crops smaller than the 16^3 fixture box
    return cfg


def vit_cfg(root, mode, workers=0, **kw):
    return build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                        {"data_root": root, "img_size": "[16,32]", "data_loader_config": mode,
                         "limit_nsamples_val": "6", "num_data_workers": str(workers), **kw})


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def assert_same(got, want):
    assert len(got) == len(want) > 0
    for (x, y), (a, b) in zip(got, want):
        assert x.dtype == a.dtype and x.device == a.device
        assert torch.equal(x, a) and torch.equal(y, b)


@pytest.mark.parametrize("model", ["unet", "vit"])
@pytest.mark.parametrize("mode,workers", [("lowmem", 2), ("inmem", 0)])
def test_dali_batches_equal_the_pytorch_batches(dali, cosmo_root, era5_root, model, mode,
                                                workers):
    """Train batches of two epochs and the validation batches (last one partial) are those of
    the PyTorch loader of the matching mode."""
    make = unet_cfg if model == "unet" else vit_cfg
    root = cosmo_root if model == "unet" else era5_root
    cfg = make(root, mode, workers)
    ref = build_loaders(cfg, 1, 0, 4, CPU)
    ld = build_loaders(make(root, f"dali-{mode}", workers), 1, 0, 4, CPU)
    assert (ld.steps_per_epoch, ld.n_train, ld.n_valid) == \
        (ref.steps_per_epoch, ref.n_train, ref.n_valid)
    for epoch in (0, 1):
        ref.train_sampler.set_epoch(epoch)
        ld.train_sampler.set_epoch(epoch)
        assert len(ld.train) == len(ref.train)
        assert_same(batches(ld.train), batches(ref.train))
    want = batches(ref.valid)
    assert [len(x) for x, _ in want] == [4, 2]
    assert len(ld.valid) == 2
    assert_same(batches(ld.valid), want)
    assert_same(batches(ld.valid), want)  # validation is the same every time


def test_dali_rotation_turns_vector_channels(dali):
    """All 24 rotations of a hand-made volume through the DALI operators: the grid moves as
    utils.rotations says, and a constant vector field v becomes R v (not v, as a plain array
    rotation would leave it)."""
    from nvidia.dali import fn, pipeline_def

    from utils.dali_loader import _rotate, rotation_arguments
    from utils.rotations import rotate_volume

    rng = np.random.default_rng(0)
    side, vc, v = 6, (1, 2, 3), np.array([1.0, 2.0, 3.0], np.float32)
    vol = np.concatenate([rng.standard_normal((1, side, side, side)),
                          np.broadcast_to(v[:, None, None, None], (3, side, side, side))])
    vol = vol.astype(np.float32)
    args = [rotation_arguments(r, vc, 4) for r in range(24)]

    @pipeline_def(batch_size=24, num_threads=1, device_id=None, enable_conditionals=True)
    def pipe():
        x = fn.external_source(source=lambda: [vol] * 24, batch=True, layout="CDHW")
        k, flips, src, mul = fn.external_source(
            source=lambda: [list(a) for a in zip(*args)], batch=True, num_outputs=4)
        return _rotate(fn, x, k, flips, src, mul, vc, 4, gpu=False)

    p = pipe()
    p.build()
    (out,) = p.run()
    for r in range(24):
        got = np.array(out[r])
        np.testing.assert_array_equal(got, rotate_volume(vol, ROTATIONS[r], vc))
        turned = matrix(ROTATIONS[r]) @ v
        assert all((got[1 + i] == turned[i]).all() for i in range(3))
    assert sum(not np.array_equal(matrix(R), np.eye(3)) for R in ROTATIONS) == 23


@pytest.mark.parametrize("model", ["unet", "vit"])
def test_dali_sharding_and_mid_epoch_resume(dali, cosmo_root, era5_root, model):
    """Two data-parallel ranks: each DALI rank's batches are the PyTorch rank's; a resumed epoch
    (start_step 1) gives the uninterrupted epoch's remaining batches, also after an epoch that
    was abandoned after one batch."""
    make = unet_cfg if model == "unet" else vit_cfg
    root = cosmo_root if model == "unet" else era5_root
    for rank in (0, 1):
        ref = build_loaders(make(root, "lowmem"), 2, rank, 2, CPU)
        ld = build_loaders(make(root, "dali-lowmem"), 2, rank, 2, CPU)
        ref.train_sampler.set_epoch(3)
        want = batches(ref.train)
        ld.train_sampler.set_epoch(2)
        next(iter(ld.train))  # abandoned
        ld.train_sampler.set_epoch(3)
        assert_same(batches(ld.train), want)
        ld.train_sampler.set_epoch(3, start_step=1)
        assert len(ld.train) == len(want) - 1
        assert_same(batches(ld.train), want[1:])
        assert_same(batches(ld.valid), batches(ref.valid))


def test_missing_dali_names_the_install(monkeypatch, cosmo_root):
    real_import = builtins.__import__

    def no_dali(name, *args, **kw):
        if name.startswith("nvidia"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    with pytest.raises(ConfigError, match=r"not installed .*: pip install -r requirements-dali.txt"):
        build_loaders(unet_cfg(cosmo_root, "dali-lowmem"), 1, 0, 4, CPU)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    with pytest.raises(ConfigError, match=r"\(pip install -r requirements-dali.txt\).* not Darwin"):
        build_loaders(unet_cfg(cosmo_root, "dali-inmem"), 1, 0, 4, CPU)


def test_quickstarts_train_with_dali(dali, tmp_path):
    """Both models train a few steps with dali-lowmem through train.py and report validation."""
    era5 = write_era5(str(tmp_path / "era5"), steps=20)
    r = train(TINY_VIT + ["--data_root", era5, "--expdir", str(tmp_path / "vit"),
                          "--num_epochs", "2", "--limit_nsamples_val", "8", "--lr", "3e-3",
                          "--data_loader_config", "dali-lowmem", "--num_data_workers", "2"])
    (v1, _), (v2, _) = baseline_and_val(r.stdout)
    assert v2 < v1, (v1, v2)
    cosmo = write_cosmo_pair(tmp_path / "cosmo", side=32)
    r = train(TINY_UNET + ["--data_root", cosmo, "--expdir", str(tmp_path / "unet"), "--num_epochs", "2",
                           "--Nsamples", "16", "--Nsamples_val", "4", "--data_loader_config", "dali-lowmem",
                           "--num_data_workers", "1"])
    assert len(baseline_and_val(r.stdout)) == 2
    assert os.path.isdir(tmp_path / "unet")
