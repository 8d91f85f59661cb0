import collections
import os

import h5py
import numpy as np
import pytest
import torch

from conftest import ERA5_MEANS, ERA5_STDS, era5_value, write_era5
from utils.config import build_config
from utils.cosmo_data import CosmoCropDataset
from utils.data_loader import ShardedSampler, ValidationSampler, build_loaders
from utils.era5_data import ERA5Dataset
from utils.errors import DataError
from utils.rotations import ROTATIONS, rotate_volume

from conftest import ROOT


def era5_ds(root, **kw):
    args = dict(data_root=root, img_size=(16, 32), dt=1, n_in=20, n_out=20)
    args.update(kw)
    return ERA5Dataset(os.path.join(root, "train"), **args)


def test_era5_pairs_normalised_and_aligned(era5_root):
    ds = era5_ds(era5_root, dt=2, img_size=(8, 16))
    assert len(ds) == 2 * (12 - 2)
    for i in range(len(ds)):
        k, t = ds.locate(i)
        year = 2016 + k
        x, y = ds[i]
        assert x.shape == (20, 8, 16) and y.shape == (20, 8, 16)
        for c in (0, 7, 19):
            raw_x = era5_value(year, t, c, 16, 32)[:8, :16]
            raw_y = era5_value(year, t + 2, c, 16, 32)[:8, :16]
            np.testing.assert_allclose(x[c].numpy(), (raw_x - ERA5_MEANS[c]) / ERA5_STDS[c], atol=1e-4)
            np.testing.assert_allclose(y[c].numpy(), (raw_y - ERA5_MEANS[c]) / ERA5_STDS[c], atol=1e-4)


def test_every_time_pair_equally_likely(era5_root):
    """One epoch visits every valid (year, t) pair exactly once, the years' first steps included
    (the reference folded early indices onto others)."""
    ds = era5_ds(era5_root)
    pairs = {(2016 + k, t) for k in range(2) for t in range(11)}
    n = len(ds)
    assert n == len(pairs)
    counts = collections.Counter()
    for epoch in range(3):
        s = ShardedSampler(n, global_batch=n, local_batch=n, dp_rank=0, shuffle=True, seed=5)
        s.set_epoch(epoch)
        seen = [ds.locate(i) for _, i in s]
        assert len(seen) == n and {(2016 + k, t) for k, t in seen} == pairs
        counts.update(seen)
    assert set(counts.values()) == {3}


def test_limit_nsamples_spreads_over_years(era5_root):
    ds = era5_ds(era5_root, limit_nsamples=6)
    years = {ds.locate(i)[0] for i in range(len(ds))}
    assert len(ds) == 6 and years == {0, 1}


def test_sharded_sampler_disjoint_complete_and_resumable():
    n, G = 50, 12
    full = list(ShardedSampler(n, G, G, 0, seed=3))
    assert len(full) == (n // G) * G and len(set(full)) == len(full)
    for ranks in (2, 4):
        b = G // ranks
        shards = [list(ShardedSampler(n, G, b, r, seed=3)) for r in range(ranks)]
        # step s of the union of the ranks is exactly step s of the serial order
        for s in range(n // G):
            union = sum((sh[s * b:(s + 1) * b] for sh in shards), [])
            assert union == full[s * G:(s + 1) * G]
    s = ShardedSampler(n, G, G, 0, seed=3)
    s.set_epoch(0, start_step=2)
    assert list(s) == full[2 * G:]
    s.set_epoch(1)
    assert list(s) != full  # a new order each epoch


def test_validation_shards_complete():
    for ranks in (1, 2, 3, 4):
        got = sorted(i for r in range(ranks) for _, i in ValidationSampler(10, ranks, r))
        assert got == list(range(10))


def test_cosmo_crops_aligned_and_rotated(cosmo_root):
    path = os.path.join(cosmo_root, "train.h5")
    ds = CosmoCropDataset(path, size=8, nsamples=200, nbody_vector_channels=(1, 2, 3),
                          hydro_vector_channels=(2, 3, 4), augment=True, seed=0)
    with h5py.File(path) as f:
        nbody = f["Nbody"][:]
    rots = set()
    for i in range(200):
        x, y = ds[(0, i)]
        (a, b, c), r = ds.window(0, i)
        rots.add(r)
        crop = nbody[:, a:a + 8, b:b + 8, c:c + 8]
        np.testing.assert_array_equal(x.numpy(), rotate_volume(crop, ROTATIONS[r], (1, 2, 3)))
        # Same window and rotation for the target: the pointwise relations hold exactly.
        np.testing.assert_allclose(y[0].numpy(), 2 * x[0].numpy(), rtol=1e-6)
        np.testing.assert_allclose(y[1].numpy(), x[0].numpy() ** 2, rtol=1e-5)
        np.testing.assert_allclose(y[2:].numpy(), 3 * x[1:].numpy(), rtol=1e-6)
    assert len(rots) == 24
    # deterministic per (seed, epoch, index); a new epoch draws new windows
    assert torch.equal(ds[(0, 5)][0], ds[(0, 5)][0])
    assert not torch.equal(ds[(0, 5)][0], ds[(1, 5)][0])


def test_cosmo_validation_is_fixed_and_unrotated(cosmo_root):
    ds = CosmoCropDataset(os.path.join(cosmo_root, "valid.h5"), size=8, nsamples=10, augment=False)
    assert all(ds.window(e, 3)[1] == 0 for e in range(5))
    assert torch.equal(ds[(0, 3)][0], ds[(4, 3)][0])


def test_inmem_equals_lowmem(cosmo_root, era5_root):
    path = os.path.join(cosmo_root, "train.h5")
    a = CosmoCropDataset(path, size=8, nsamples=5, nbody_vector_channels=(1, 2, 3), inmem=False)
    b = CosmoCropDataset(path, size=8, nsamples=5, nbody_vector_channels=(1, 2, 3), inmem=True)
    for i in range(5):
        assert torch.equal(a[(2, i)][0], b[(2, i)][0]) and torch.equal(a[(2, i)][1], b[(2, i)][1])
    a, b = era5_ds(era5_root), era5_ds(era5_root, inmem=True)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(len(a)))


def test_loader_workers_give_the_same_batches(cosmo_root):
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "quickstart",
                       {"data_root": cosmo_root, "Nsamples": "12", "Nsamples_val": "4"})
    cfg.data_size = 8  # crops smaller than the 16^3 fixture box (the loader does not need 2^5)
    batches = []
    for workers in (0, 2):
        cfg.num_data_workers = workers
        ld = build_loaders(cfg, 1, 0, 4, torch.device("cpu"))
        ld.train_sampler.set_epoch(1)
        batches.append([x for x, _ in ld.train])
    assert len(batches[0]) == 3
    assert all(torch.equal(a, b) for a, b in zip(*batches))


def test_missing_and_malformed_files(tmp_path, era5_root):
    with pytest.raises(DataError, match="no ERA5 year files"):
        era5_ds(str(tmp_path / "nothing"))
    bad = os.path.join(era5_root, "train", "2019.h5")
    with open(bad, "wb") as f:
        f.write(b"not an hdf5 file")
    with pytest.raises(DataError, match="2019.h5 is not a readable HDF5 file"):
        era5_ds(era5_root)
    os.remove(bad)
    with h5py.File(bad, "w") as f:
        f["wrong"] = np.zeros(3)
    with pytest.raises(DataError, match="has no dataset 'fields'"):
        era5_ds(era5_root)
    os.remove(bad)
    with pytest.raises(DataError, match="smaller than the model needs"):
        era5_ds(era5_root, img_size=(32, 32))
    os.remove(os.path.join(era5_root, "stats", "global_stds.npy"))
    with pytest.raises(DataError, match="global_stds.npy not found"):
        era5_ds(era5_root)
    with pytest.raises(DataError, match="not found"):
        CosmoCropDataset(str(tmp_path / "none.h5"), size=8, nsamples=1)


def test_nan_in_data_is_named(tmp_path):
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 2, 2] = np.nan
    ds = era5_ds(root)
    bad = [i for i in range(len(ds)) if ds.locate(i) in ((1, 3), (1, 2))]
    with pytest.raises(DataError, match=r"non-finite values in .*2017.h5 at step"):
        ds[bad[0]]
