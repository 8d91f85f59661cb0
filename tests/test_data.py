import collections
import inspect
import os
import re

import h5py
import numpy as np
import pytest
import torch

import preloaded
from conftest import ERA5_MEANS, ERA5_STDS, era5_value, write_era5
from settings.parse import build_config
from datapipe import synthetic
from datapipe.cosmo_data import CosmoCropDataset
from datapipe.data_loader import ShardedSampler, ValidationSampler, build_loaders
from datapipe.era5_data import ERA5Dataset
from settings.errors import DataError
from datapipe.rotations import ROTATIONS
from loader_harness import rotate_volume
from tasks import make_task

from conftest import ROOT


def era5_ds(root, **kw):
    args = dict(data_root=root, img_size=(16, 32), dt=1, n_in=20, n_out=20)
    args.update(kw)
    return ERA5Dataset(os.path.join(root, "train"), **args)


def test_era5_pairs_raw_aligned_and_normalised_by_the_task(era5_root, tmp_path):
    """The dataset gives the stored values of the (t, t + dt) pair; ``ERA5Task.device_batch``
    normalises them with the global stats, per channel, for the model's channel counts."""
    ds = era5_ds(era5_root, dt=2, img_size=(8, 16))
    assert len(ds) == 2 * (12 - 2)
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       {"data_root": era5_root, "expdir": str(tmp_path), "n_out_channels": "3"})
    task = make_task(cfg)
    for i in range(len(ds)):
        k, t = ds.locate(i)
        year = 2016 + k
        x, y = ds[i]
        assert x.shape == (20, 8, 16) and y.shape == (20, 8, 16) and x.dtype == torch.float32
        nx, ny = task.device_batch(x[None], y[None, :3])
        assert nx.shape == (1, 20, 8, 16) and ny.shape == (1, 3, 8, 16)
        for c in (0, 2, 7, 19):
            raw_x = era5_value(year, t, c, 16, 32)[:8, :16]
            raw_y = era5_value(year, t + 2, c, 16, 32)[:8, :16]
            np.testing.assert_allclose(x[c].numpy(), raw_x, rtol=1e-6)
            np.testing.assert_allclose(y[c].numpy(), raw_y, rtol=1e-6)
            np.testing.assert_allclose(nx[0, c].numpy(), (raw_x - ERA5_MEANS[c]) / ERA5_STDS[c], atol=1e-4)
            if c < 3:
                np.testing.assert_allclose(ny[0, c].numpy(), (raw_y - ERA5_MEANS[c]) / ERA5_STDS[c],
                                           atol=1e-4)


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
        (a, b, c), r = ds.window((0, i))
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


def test_rotated_crops_are_read_into_place(tmp_path):
    """From the file a rotated crop is read once, straight into its slot of the batch, and
    turned there: no buffer of a crop's size is made beside the batch (in memory: copied once
    from the volume through a rotated view); the crops equal the rotated windows."""
    import tracemalloc

    from conftest import write_cosmo

    path = write_cosmo(str(tmp_path / "c64.h5"), side=64)
    ds = CosmoCropDataset(path, size=32, nsamples=64, nbody_vector_channels=(1, 2, 3),
                          hydro_vector_channels=(2, 3, 4), seed=2)
    keys = [(0, i) for i in range(64) if ds.window((0, i))[1]][:6]
    x, y = np.empty((6, 4, 32, 32, 32), np.float32), np.empty((6, 5, 32, 32, 32), np.float32)
    ds.read_batch(keys, x, y)  # the file opened, the plans made
    tracemalloc.start()
    ds.read_batch(keys, x, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < y[0].nbytes / 4 + 64 * 1024, peak
    with h5py.File(path) as f:
        nbody, hydro = f["Nbody"][:], f["Hydro"][:]
    for j, key in enumerate(keys):
        (a, b, c), r = ds.window(key)
        crop = np.s_[:, a:a + 32, b:b + 32, c:c + 32]
        np.testing.assert_array_equal(x[j], rotate_volume(nbody[crop], ROTATIONS[r], (1, 2, 3)))
        np.testing.assert_array_equal(y[j], rotate_volume(hydro[crop], ROTATIONS[r], (2, 3, 4)))


def test_cosmo_validation_is_fixed_and_unrotated(cosmo_root):
    ds = CosmoCropDataset(os.path.join(cosmo_root, "valid.h5"), size=8, nsamples=10, augment=False)
    assert all(ds.window((e, 3))[1] == 0 for e in range(5))
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
    stds = os.path.join(era5_root, "stats", "global_stds.npy")
    # (the last: a header numpy's tokenizer gives up on, which np.load raises as TokenError)
    for content in (os.urandom(300), b"", b"\x93NUMPY\x01\x00" + os.urandom(100),
                    b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4" + b" " * 6 + b"\n"):
        with open(stds, "wb") as f:
            f.write(content)
        with pytest.raises(DataError, match=r"global_stds.npy is not a valid .npy file") as e:
            era5_ds(era5_root)
        assert "pickle" not in str(e.value) and len(str(e.value).splitlines()) == 1, e.value
    os.remove(stds)
    with pytest.raises(DataError, match="global_stds.npy not found"):
        era5_ds(era5_root)
    with pytest.raises(DataError, match="not found") as e:
        CosmoCropDataset(str(tmp_path / "none.h5"), size=8, nsamples=1)
    # the generator it suggests writes other names than the tutorial's: the message gives them
    defaults = inspect.signature(synthetic.make_cosmo).parameters
    names = defaults["train_name"].default, defaults["val_name"].default
    assert f"--train_file {names[0]} --val_file {names[1]}" in str(e.value)


def test_nan_in_data_is_named(tmp_path):
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 2, 2] = np.nan
    ds = era5_ds(root)
    bad = [i for i in range(len(ds)) if ds.locate(i) in ((1, 3), (1, 2))]
    with pytest.raises(DataError, match=r"non-finite values in .*2017.h5 at step"):
        ds[bad[0]]


@pytest.mark.parametrize("inmem", [False, True], ids=["lowmem", "inmem"])
def test_era5_rows_are_the_band_of_the_full_sample(era5_root, inmem):
    full = era5_ds(era5_root, inmem=inmem)
    for rows in ((4, 12), (0, 3), (13, 16)):
        band = era5_ds(era5_root, inmem=inmem, rows=rows)
        assert len(band) == len(full)
        for i in range(len(full)):
            (x, y), (bx, by) = full[i], band[i]
            assert bx.shape == (20, rows[1] - rows[0], 32)
            assert torch.equal(bx, x[:, rows[0]:rows[1]]) and torch.equal(by, y[:, rows[0]:rows[1]])
    if inmem:  # only the band is held in memory
        assert all(a.shape[2] == 3 for a in era5_ds(era5_root, inmem=True, rows=(13, 16))._arrays)


def test_era5_rows_read_and_check_only_the_band(tmp_path):
    """A NaN outside a rank's rows is never read by it; one inside is named with the rows."""
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 2, 2] = np.nan  # row 2
    for inmem in (False, True):
        above, below = era5_ds(root, rows=(0, 8), inmem=inmem), era5_ds(root, rows=(8, 16), inmem=inmem)
        bad = [i for i in range(len(above)) if above.locate(i) in ((1, 3), (1, 2))]
        with pytest.raises(DataError, match=r"2017.h5 at step \d+ or \d+ \(rows 0:8\)"):
            above[bad[0]]
        assert all(torch.isfinite(below[i][0]).all() for i in bad)


def test_era5_rows_refused_outside_the_image(era5_root):
    for rows in ((0, 17), (5, 5), (-1, 4), (3,), "top", (0.0, 8.5)):
        with pytest.raises(ValueError, match=r"rows=.*(choose 0 <= start < stop <= 16|\(start, stop\))"):
            era5_ds(era5_root, rows=rows)


@pytest.mark.parametrize("mode", ["lowmem", "inmem"])
def test_loader_rows_limit_training_batches_only(era5_root, tmp_path, mode):
    """Training batches are rows start:stop of the full loader's batches, with and without
    workers; validation batches stay whole images."""
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       {"data_root": era5_root, "expdir": str(tmp_path), "img_size": "[16,32]",
                        "data_loader_config": mode, "limit_nsamples_val": "4"})
    full = build_loaders(cfg, 1, 0, 4, torch.device("cpu"))
    full.train_sampler.set_epoch(1)
    want = [(x[:, :, 8:12], y[:, :, 8:12]) for x, y in full.train]
    valid = [x for x, _ in full.valid]
    assert len(want) == 5
    for workers in (0, 2):
        cfg.num_data_workers = workers
        ld = build_loaders(cfg, 1, 0, 4, torch.device("cpu"), rows=(8, 12))
        ld.train_sampler.set_epoch(1)
        got = list(ld.train)
        assert len(got) == len(want)
        assert all(torch.equal(x, a) and torch.equal(y, b) for (x, y), (a, b) in zip(got, want))
        assert all(torch.equal(x, v) and x.shape[2] == 16 for (x, _), v in zip(ld.valid, valid))
    cfg.num_data_workers = 0
    unet = build_config(f"{ROOT}/config/UNet.yaml", "quickstart", {"data_root": str(tmp_path)})
    with pytest.raises(ValueError, match="rows=.*pass rows=None"):
        build_loaders(unet, 1, 0, 4, torch.device("cpu"), rows=(0, 8))


def test_memory_model_counts_the_batch_rows_a_rank_loads():
    """The memory model's batch on the device is the rank's rows: 1/T of the image with row
    bands, the cp band when padded (cp = 2 on 45 patch rows: 23 rows, the longer band)."""
    from benchmarks.memory_model import Shape, predict

    s = Shape(batch=2, img=(360, 720), patch=8, cin=20, cout=20, embed=64, depth=1, heads=4, hidden=256)
    key = "batch on the device (x and y, the rank's rows)"
    whole = 4 * 2 * 40 * 360 * 720

    def batch(tp, cp, img=(360, 720)):
        return predict(Shape(**{**s.__dict__, "img": img}), tp, cp).extra[key]

    assert batch(1, 1) == whole
    assert batch(4, 1) == whole  # padded: every tp rank embeds the whole cp band
    assert batch(1, 2) == whole * 184 // 360
    assert batch(4, 1, (352, 720)) == whole * 88 // 360  # row bands
    assert batch(2, 2) == whole * 184 // 360


def test_batches_are_the_samples_read_into_one_buffer(era5_root, cosmo_root, tmp_path):
    """A loader batch is the stack of the dataset's samples for the sampler's keys, read straight
    into the batch (no collate): with or without workers, into one of the loader's pooled
    buffers (shared memory made by the main process)."""
    vit = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       {"data_root": era5_root, "expdir": str(tmp_path), "img_size": "[16,32]",
                        "limit_nsamples_val": "4"})
    unet = build_config(f"{ROOT}/config/UNet.yaml", "quickstart",
                        {"data_root": cosmo_root, "Nsamples": "8", "Nsamples_val": "4"})
    unet.data_size = 8
    for cfg in (vit, unet):
        for workers in (0, 2):
            cfg.num_data_workers = workers
            ld = build_loaders(cfg, 1, 0, 4, torch.device("cpu"))
            ld.train_sampler.set_epoch(3)
            keys = list(ld.train_sampler)
            ds = ld.train.dataset
            got = list(ld.train)
            assert len(got) * 4 == len(keys) >= 8
            for s, (x, y) in enumerate(got):
                want = [ds[key] for key in keys[4 * s:4 * s + 4]]
                assert torch.equal(x, torch.stack([a for a, _ in want]))
                assert torch.equal(y, torch.stack([b for _, b in want]))
                slots = ld.train.pool.slots
                assert any(b.address <= x.data_ptr() < b.address + b.layout.nbytes for b in slots)
                assert any(b.address <= y.data_ptr() < b.address + b.layout.nbytes for b in slots)


def test_cosmo_device_batch_is_the_identity(tmp_path):
    cfg = build_config(f"{ROOT}/config/UNet.yaml", "quickstart", {"data_root": str(tmp_path)})
    x, y = torch.randn(2, 4, 8, 8, 8), torch.randn(2, 5, 8, 8, 8)
    a, b = make_task(cfg).device_batch(x, y)
    assert a is x and b is y


def test_nan_in_a_batch_names_its_sample(tmp_path, cosmo_root):
    """The once-per-batch check still names the file and step (ERA5) or crop (cosmology) of the
    sample that holds the NaN, whichever slot of the batch it is in."""
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 2, 2] = np.nan
    ds = era5_ds(root)
    bad = next(i for i in range(len(ds)) if ds.locate(i) == (1, 3))
    good = [i for i in range(len(ds)) if ds.locate(i) not in ((1, 3), (1, 2))][:3]
    x, y = np.empty((4, 20, 16, 32), np.float32), np.empty((4, 20, 16, 32), np.float32)
    ds.read_batch(good + [(0, good[0])], x, y)  # finite: no error
    with pytest.raises(DataError, match=r"2017.h5 at step 3 or 4 \(rows 0:16\)"):
        ds.read_batch(good[:2] + [bad] + good[2:], x, y)
    path = os.path.join(cosmo_root, "train.h5")
    with h5py.File(path, "r+") as f:
        f["Hydro"][2, 5, 5, 5] = np.inf
    cs = CosmoCropDataset(path, size=8, nsamples=64, hydro_vector_channels=(2, 3, 4), seed=1)
    hit = [i for i in range(64) if all(a <= 5 < a + 8 for a in cs.window((0, i))[0])]
    assert hit
    x, y = np.empty((2, 4, 8, 8, 8), np.float32), np.empty((2, 5, 8, 8, 8), np.float32)
    corner = tuple(int(a) for a in cs.window((0, hit[0]))[0])
    with pytest.raises(DataError, match=r"non-finite values in .*train.h5 in the crop at "
                       + re.escape(str(corner)) + ": "):  # plain numbers, not np.int64(...)
        cs.read_batch([(0, (hit[0] + 1) % 64), (0, hit[0])], x, y)
    with pytest.raises(DataError, match="holds non-finite values"):
        CosmoCropDataset(path, size=8, nsamples=4, inmem=True)


# ----------------------------------------------------------------------------- stored types


@pytest.mark.parametrize("inmem", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int16, np.uint8])
def test_other_stored_types_read_as_float32(tmp_path, era5_root, cosmo_root, dtype, inmem):
    """Fields stored as float64 (or float16, or integers of up to 16 bits) give the float32
    samples of the same values stored as float32."""
    from conftest import write_cosmo_pair

    other = write_era5(str(tmp_path / "other"), dtype=dtype)
    kw = dict(img_size=(16, 32), inmem=inmem)
    ref = ERA5Dataset(os.path.join(era5_root, "train"), era5_root, **kw)
    got = ERA5Dataset(os.path.join(other, "train"), other, **kw)
    for i in (0, 5, len(ref) - 1):
        expect = [torch.from_numpy(a.numpy().astype(dtype).astype(np.float32)) for a in ref[i]]
        for g, e in zip(got[i], expect):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    cosmo_other = write_cosmo_pair(tmp_path / "cosmo_other", dtype=dtype)
    ref = CosmoCropDataset(os.path.join(cosmo_root, "train.h5"), 8, 4, inmem=inmem)
    got = CosmoCropDataset(os.path.join(cosmo_other, "train.h5"), 8, 4, inmem=inmem)
    for g, r in zip(got[(1, 2)], ref[(1, 2)]):
        torch.testing.assert_close(g, torch.from_numpy(r.numpy().astype(dtype).astype(np.float32)),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.complex64, np.bool_])
def test_inexact_stored_types_are_refused_with_file_dataset_and_type(tmp_path, dtype):
    from conftest import write_cosmo

    root = write_era5(str(tmp_path / "era5"), dtype=dtype)
    with pytest.raises(DataError, match=rf"2016\.h5: dataset 'fields' is stored as "
                                        rf"{np.dtype(dtype)}.*store it as float32"):
        ERA5Dataset(os.path.join(root, "train"), root, img_size=(16, 32))
    path = write_cosmo(str(tmp_path / "c.h5"), dtype=dtype)
    with pytest.raises(DataError, match=rf"c\.h5: dataset 'Nbody' is stored as {np.dtype(dtype)}"):
        CosmoCropDataset(path, 8, 4)


def test_packed_values_are_refused(tmp_path):
    root = write_era5(str(tmp_path / "era5"), dtype=np.int16)
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"].attrs["scale_factor"] = 0.01
    with pytest.raises(DataError, match=r"2017\.h5: dataset 'fields' holds packed int16 values "
                                        r"\(scale_factor attributes\)"):
        ERA5Dataset(os.path.join(root, "train"), root, img_size=(16, 32))


def test_float64_data_trains(tmp_path):
    """A whole run on float64 files: the same losses as on the float32 files of the same values
    (the fixture's values are exact in float32)."""
    import sys

    def run(dtype):
        root = write_era5(str(tmp_path / np.dtype(dtype).name), dtype=dtype)
        r = preloaded.run(
            [sys.executable, "train.py", "--img_size", "[16,32]", "--patch_size", "4",
             "--embed_dim", "32", "--depth", "1", "--num_heads", "2", "--global_batch_size", "4",
             "--base_batch_size", "4", "--synthesize_if_missing", "false", "--num_iters", "4",
             "--data_root", root, "--expdir", str(tmp_path / f"logs_{np.dtype(dtype).name}")],
            cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr[-2000:]
        return [line.split(" - ")[-1] for line in r.stdout.splitlines() if "loss=" in line]

    losses = run(np.float64)
    assert losses and losses == run(np.float32)


def test_a_finished_run_ends_its_loader_workers(tmp_path, era5_root):
    """Persistent workers end with the run, not whenever garbage collection gets to them (which
    could cost torch's 5 s join timeout per worker)."""
    import multiprocessing

    from train import run
    from settings.cli import from_argv

    before = set(multiprocessing.active_children())
    run(from_argv(["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth",
                   "1", "--num_heads", "2", "--global_batch_size", "4", "--data_root", era5_root,
                   "--synthesize_if_missing", "false", "--expdir", str(tmp_path),
                   "--num_iters", "2", "--num_data_workers", "2"]))
    assert set(multiprocessing.active_children()) <= before
