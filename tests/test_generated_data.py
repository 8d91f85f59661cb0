"""--data_loader_config synthetic: batches made in memory, nothing read from or written to
data_root, the samples those of the synthetic generator's files, the real samplers' epochs."""
import os
import re
import sys

import h5py
import numpy as np
import pytest
import torch

import preloaded
from conftest import ROOT
from datapipe import generated_data, synthetic
from settings.parse import build_config
from datapipe.data_loader import build_loaders
from datapipe.make_data import synthesize
from datapipe.data_sets import data_set
from datapipe.era5_data import load_stats
from settings.errors import ConfigError, DataError
from tasks import make_task

CPU = torch.device("cpu")
VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")
UNET_YAML = os.path.join(ROOT, "config", "UNet.yaml")


def vit_cfg(root, **kw):
    over = dict(img_size="[16,32]", patch_size="4", embed_dim="32", depth="1", num_heads="2",
                global_batch_size="4", base_batch_size="4", data_root=str(root),
                synthetic_steps_per_year="12", num_iters="2", data_loader_config="synthetic")
    return build_config(VIT_YAML, "quickstart", dict(over, **{k: str(v) for k, v in kw.items()}))


def unet_cfg(root, **kw):
    over = dict(base_width="4", max_width="16", data_size="32", synthetic_size="[40,32]",
                Nsamples="12", Nsamples_val="6", global_batch_size="4", base_batch_size="4",
                data_root=str(root), num_iters="2", data_loader_config="synthetic")
    return build_config(UNET_YAML, "quickstart", dict(over, **{k: str(v) for k, v in kw.items()}))


def first(loader):
    x, y = next(iter(loader))
    return x.numpy(), y.numpy()


def test_unet_batches_are_the_crops_of_the_generator_files(tmp_path):
    """The generated boxes are those python -m datapipe.synthetic cosmo writes for the seed: the
    generated batches equal the batches the file loader reads from them (rotations included)."""
    cfg = unet_cfg(tmp_path / "cosmo", seed=5)
    gen = build_loaders(cfg, 1, 0, 4, CPU)
    synthesize(cfg)  # the same seed and sizes, written to files
    files = build_loaders(build_config(UNET_YAML, "quickstart", dict(
        data_size="32", Nsamples="12", Nsamples_val="6", global_batch_size="4", seed="5",
        data_root=str(tmp_path / "cosmo"), synthetic_size="[40,32]")), 1, 0, 4, CPU)
    for a, b in zip(first(gen.train) + first(gen.valid), first(files.train) + first(files.valid)):
        np.testing.assert_array_equal(a, b)
    assert (gen.n_train, gen.n_valid, gen.steps_per_epoch) == (12, 6, 3)
    # the predict-the-mean baseline comes from the generated training box, like from the file
    mean_gen = make_task(cfg).target_mean()
    cfg_files = build_config(UNET_YAML, "quickstart", dict(data_root=str(tmp_path / "cosmo")))
    np.testing.assert_allclose(mean_gen, make_task(cfg_files).target_mean(), rtol=1e-12)


def test_era5_batches_are_the_generator_fields(tmp_path):
    """Inputs are the generator's states at the sampled steps of the first training year, targets
    dt steps later; a band of rows is those rows of the whole image; the steps are the fields
    make_era5 writes into the year files."""
    cfg = vit_cfg(tmp_path / "none", dt=2, limit_nsamples=20, limit_nsamples_val=6, seed=3)
    loaders = build_loaders(cfg, 1, 0, 4, CPU)
    keys = [i for _, i in list(loaders.train_sampler)[:4]]
    start = (synthetic.YEARS["train"][0] - synthetic.EPOCH_YEAR) * 12
    x, y = first(loaders.train)
    fields = synthetic.era5_fields(start + np.array(keys + [k + 2 for k in keys]), (16, 32), 12, 3)
    np.testing.assert_array_equal(x, fields[:4])
    np.testing.assert_array_equal(y, fields[4:])
    xv, _ = first(loaders.valid)  # validation follows the last training target
    np.testing.assert_array_equal(xv, synthetic.era5_fields(start + 22 + np.arange(4), (16, 32), 12, 3))

    band = build_loaders(cfg, 1, 0, 4, CPU, rows=(4, 12))
    xb, yb = first(band.train)
    np.testing.assert_array_equal(xb, x[:, :, 4:12])
    np.testing.assert_array_equal(yb, y[:, :, 4:12])
    assert first(band.valid)[0].shape[-2] == 16  # validation keeps whole images

    synthetic.make_era5(str(tmp_path / "files"), img_size=(16, 32), steps_per_year=12, seed=3)
    with h5py.File(tmp_path / "files" / "train" / "2014.h5") as f:
        np.testing.assert_array_equal(f["fields"][:], synthetic.era5_fields(
            start + np.arange(12), (16, 32), 12, 3))


def test_era5_statistics_normalise_the_generated_fields(tmp_path):
    cfg = vit_cfg(tmp_path / "none", limit_nsamples=48, global_batch_size=16)
    task = make_task(cfg)
    loaders = build_loaders(cfg, 1, 0, 16, CPU)
    x, y = task.device_batch(*next(iter(loaders.train)))
    per_channel = x.transpose(0, 1).reshape(x.shape[1], -1)
    assert torch.isfinite(x).all() and torch.isfinite(y).all()
    assert per_channel.mean(dim=1).abs().max() < 1.0
    assert ((per_channel.std(dim=1) > 0.3) & (per_channel.std(dim=1) < 3.0)).all()
    # close to the statistics make_era5 stores for the same trajectory (over its training years)
    synthetic.make_era5(str(tmp_path / "files"), img_size=(16, 32), steps_per_year=12, seed=0)
    means, stds = load_stats(str(tmp_path / "files"), 20)
    gen_means, gen_stds = generated_data.era5_stats(cfg)
    assert gen_means.shape == means.shape == (20, 1, 1)
    assert np.all(np.abs(gen_means - means) < 0.5 * stds) and np.all(gen_stds < 2 * stds)


def test_epochs_shards_resume_and_validation_counts(tmp_path):
    """The real samplers decide the steps: steps per epoch, a resumed epoch's remaining steps,
    and validation batches that add up to each rank's shard (the last one cut)."""
    cfg = vit_cfg(tmp_path / "none", limit_nsamples=30, limit_nsamples_val=11)
    ranks = [build_loaders(cfg, 2, r, 2, CPU) for r in (0, 1)]
    for loaders in ranks:
        assert loaders.steps_per_epoch == 30 // 4 and len(loaders.train) == 7
        loaders.train_sampler.set_epoch(1, 5)
        assert len(list(loaders.train)) == 2
    sizes = [[x.shape[0] for x, _ in loaders.valid] for loaders in ranks]
    assert sizes == [[2, 2, 1], [2, 2, 2]] and sum(map(sum, sizes)) == 11
    # the two ranks' batches are the serial run's global batch
    serial = build_loaders(cfg, 1, 0, 4, CPU)
    joined = np.concatenate([first(loaders.train)[0] for loaders in ranks])
    np.testing.assert_array_equal(joined, first(serial.train)[0])
    defaults = vit_cfg(tmp_path / "none", limit_nsamples="null", limit_nsamples_val="null")
    assert data_set(defaults).generated_counts() == (1460, 1460)


def test_settings_generated_data_cannot_serve_refused(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size=8 exceeds the 6 training samples"):
        build_loaders(vit_cfg(tmp_path, limit_nsamples=6), 1, 0, 8, CPU)
    with pytest.raises(ConfigError, match=r"img_size=\[1, 4\] is too small .* at least 2 rows"):
        vit_cfg(tmp_path, img_size="[1,4]", patch_size="1")
    with pytest.raises(DataError, match="Nbody has 4 channels"):
        build_loaders(unet_cfg(tmp_path, n_in_channels=6, nbody_vector_channels="[]"), 1, 0, 4, CPU)


def train(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = preloaded.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                      text=True, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("model", ["vit", "unet"])
def test_trains_without_data_and_leaves_data_root_alone(tmp_path, model):
    """The quickstart configs (which would synthesise files) train with no data at all, and a
    data_root holding something else is neither read nor changed."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "notes.txt").write_text("not a data set")
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    common = ["--data_loader_config", "synthetic", "--expdir", str(tmp_path / "logs"),
              "--num_iters", "8", "--log_every", "4", "--data_root", str(root)]
    if model == "vit":
        args = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
                "--num_heads", "2", "--limit_nsamples", "64", "--limit_nsamples_val", "8"]
    else:
        args = ["--yaml_config", "config/UNet.yaml", "--base_width", "4", "--max_width", "16",
                "--data_size", "32", "--synthetic_size", "[32,32]", "--Nsamples", "64",
                "--Nsamples_val", "8"]
    out = train(args + common)
    assert "Generated data (data_loader_config synthetic; nothing read from data_root)" in out
    assert "generating synthetic" not in out
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before
    losses = [float(v) for v in
              re.findall(r"step \d+/\d+ \(\d+%\): .*train loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out[-2000:]  # one batch: it is learnt
    # kept apart from the config's real runs: its own name, never picked by a bare --resume
    name = "quickstart"
    assert os.listdir(tmp_path / "logs") == [f"{name}-synthetic"], os.listdir(tmp_path / "logs")
    assert (tmp_path / "logs" / f"{name}-synthetic" / "1" / "0" / "checkpoints").is_dir()
    r = preloaded.run([sys.executable, "train.py", *args, *common[2:], "--resume"], cwd=ROOT,
                      capture_output=True, text=True)
    assert r.returncode == 2 and "--resume: no run under" in r.stderr, r.stderr[-2000:]
    r = preloaded.run([sys.executable, "train.py", *args, *common, "--resume", "--num_iters",
                       "12"], cwd=ROOT, capture_output=True, text=True)  # asked for: resumed
    assert r.returncode == 0 and "Resumed from" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
