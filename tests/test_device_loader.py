"""``data_loader_config: device``: the U-Net's volumes held on the training device, crops cut and
rotated there (datapipe/device_loader.py). On a CPU the device is the CPU: the crops are copied
through rotated views there, and the GPU's one gather per field is tested here too."""
import dataclasses
import os
import re
import types

import h5py
import numpy as np
import pytest
import torch

import train as train_script
from conftest import ROOT, file_digests, write_cosmo_pair
from test_training import TINY_UNET, run_dir, train
from datapipe import device_loader
from settings.parse import build_config
from settings.cli import from_argv
from datapipe.data_loader import build_loaders
from datapipe.device_loader import VolumeNeed, check_fits, free_memory
from settings.errors import ConfigError, DataError
from engine.runtime import setup_runtime
from datapipe.rotations import ROTATIONS
from tasks import make_task

CPU = torch.device("cpu")
UNET_YAML = os.path.join(ROOT, "config", "UNet.yaml")
VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")


@pytest.fixture
def cosmo20(tmp_path):
    """Boxes of side 20 (crops of 8: many corners), vector channels as in the real data."""
    return write_cosmo_pair(tmp_path / "cosmo", side=20)


def unet_cfg(root, tmp_path, mode, size=8, **kw):
    """The U-Net quickstart on ``root`` with ``mode``; crops of ``size`` (set after validation,
    which asks the model's divisibility: the loaders do not care)."""
    over = {"data_root": root, "expdir": str(tmp_path / "logs"), "Nsamples": "24",
            "Nsamples_val": "7", "data_loader_config": mode, "num_data_workers": "0",
            "synthesize_if_missing": "false", **kw}
    return dataclasses.replace(build_config(UNET_YAML, "quickstart", over), data_size=size)


def pairs(loaders_a, loaders_b, which="train"):
    a, b = list(getattr(loaders_a, which)), list(getattr(loaders_b, which))
    assert len(a) == len(b) == len(getattr(loaders_b, which))
    return zip(a, b)


@pytest.mark.parametrize("method", ["copy", "gather"])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_device_batches_equal_lowmem_bitwise(cosmo20, tmp_path, dp_size, method):
    """Training (random corners, all 24 rotations, vector channels turned) and validation
    batches of every rank's shard equal the lowmem loader's, bit for bit, for two epochs; they
    are float32 tensors on the device. Both ways of cutting them: the CPU's copies through
    rotated views (its default) and the GPU's one gather per field."""
    rots = set()
    for rank in range(dp_size):
        low = build_loaders(unet_cfg(cosmo20, tmp_path, "lowmem"), dp_size, rank, 3, CPU)
        dev = build_loaders(unet_cfg(cosmo20, tmp_path, "device"), dp_size, rank, 3, CPU)
        assert type(dev.train).__name__ == "DeviceCropLoader"
        assert dev.train.gather.method == dev.valid.gather.method == "copy"  # CPU, float32
        dev.train.gather.method = dev.valid.gather.method = method
        assert (dev.steps_per_epoch, dev.n_train, dev.n_valid) == (
            low.steps_per_epoch, low.n_train, low.n_valid)
        for epoch in range(2):
            low.train_sampler.set_epoch(epoch)
            dev.train_sampler.set_epoch(epoch)
            rots |= {int(r) for r in dev.train.gather.windows(list(dev.train_sampler))[:, 3]}
            for (x0, y0), (x1, y1) in pairs(low, dev):
                assert x1.device == CPU and x1.dtype == y1.dtype == torch.float32
                assert x1.shape == (3, 4, 8, 8, 8) and y1.shape == (3, 5, 8, 8, 8)
                assert torch.equal(x0, x1) and torch.equal(y0, y1)
            for (x0, y0), (x1, y1) in pairs(low, dev, "valid"):  # the last batch may be short
                assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # The batches went through rotations that turn vector components backwards, and others.
    assert len(rots) > 12 and any(min(ROTATIONS[r][1]) < 0 for r in rots)


def test_resume_mid_epoch_continues_exactly(cosmo20, tmp_path):
    """``set_epoch(epoch, start_step)`` gives the rest of that epoch's batches."""
    dev = build_loaders(unet_cfg(cosmo20, tmp_path, "device", Nsamples="30"), 2, 1, 3, CPU)
    for epoch in (0, 3):
        dev.train_sampler.set_epoch(epoch)
        whole = list(dev.train)
        assert len(whole) == dev.steps_per_epoch == 5
        for start in (1, 4):
            dev.train_sampler.set_epoch(epoch, start)
            assert len(dev.train) == 5 - start
            rest = list(dev.train)
            assert len(rest) == 5 - start
            for (x0, y0), (x1, y1) in zip(whole[start:], rest):
                assert torch.equal(x0, x1) and torch.equal(y0, y1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_storage_is_the_volume_rounded(cosmo20, tmp_path, dtype):
    """The volumes are held rounded to ``dtype`` (half the bytes); batches are float32, the
    lowmem batches rounded to that type."""
    tdtype = getattr(torch, dtype)
    dev = build_loaders(unet_cfg(cosmo20, tmp_path, "device", device_volume_dtype=dtype), 1, 0, 4,
                        CPU)
    for split, gather in (("train.h5", dev.train.gather), ("valid.h5", dev.valid.gather)):
        assert gather.method == "gather"  # no numpy half type to copy through
        with h5py.File(os.path.join(cosmo20, split)) as f:
            for name, held in zip(("Nbody", "Hydro"), gather.volumes):
                stored = torch.from_numpy(f[name][:])
                assert held.dtype == tdtype and held.shape == stored.shape
                assert torch.equal(held, stored.to(tdtype))
                assert held.element_size() * 2 == stored.element_size()
    low = build_loaders(unet_cfg(cosmo20, tmp_path, "lowmem"), 1, 0, 4, CPU)
    for which in ("train", "valid"):
        for (x0, y0), (x1, y1) in pairs(low, dev, which):
            assert x1.dtype == y1.dtype == torch.float32
            assert torch.equal(x1, x0.to(tdtype).float()) and torch.equal(y1, y0.to(tdtype).float())


def test_values_beyond_float16_and_non_finite_values_are_refused(tmp_path):
    root = write_cosmo_pair(tmp_path / "cosmo", side=12)
    with h5py.File(os.path.join(root, "train.h5"), "r+") as f:
        f["Hydro"][1, 3, 4, 5] = 1e6  # fine in float32 and bfloat16, infinite in float16
    with pytest.raises(ConfigError, match=r"train.h5: 'Hydro' holds values beyond the range of "
                                          r"float16.*--device_volume_dtype bfloat16 or float32"):
        build_loaders(unet_cfg(root, tmp_path, "device", device_volume_dtype="float16"), 1, 0, 2,
                      CPU)
    build_loaders(unet_cfg(root, tmp_path, "device", device_volume_dtype="bfloat16"), 1, 0, 2, CPU)
    with h5py.File(os.path.join(root, "valid.h5"), "r+") as f:
        f["Nbody"][2, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match=r"valid.h5: 'Nbody' holds non-finite values"):
        build_loaders(unet_cfg(root, tmp_path, "device"), 1, 0, 2, CPU)


def test_memory_check_names_the_size_the_free_memory_and_the_choices():
    """The tutorial's training box, 9 channels of 1024^3: 38.7 GB in float32, half in bfloat16."""
    need = VolumeNeed(sides=(1024,), channels=(4, 5))
    assert need.volume_bytes() == 9 * 1024**3 * 4 and need.batch_bytes() == 0
    check_fits(need, free=int(80e9), where="cuda:0")  # an 80 GB GPU
    check_fits(need, free=None, where="cpu")  # unknown: the run goes on
    with pytest.raises(ConfigError) as e:
        check_fits(need, free=int(30e9), where="cuda:0")
    line = str(e.value)
    assert "\n" not in line and "38.7 GB in float32 (4 + 5 channels of 1024^3)" in line
    assert "cuda:0 has 30.0 GB free" in line
    assert "--device_volume_dtype bfloat16 (halves the volumes: 19.3 GB)" in line
    assert "--data_loader_config lowmem" in line
    half = VolumeNeed(sides=(1024,), channels=(4, 5), dtype="bfloat16")
    check_fits(half, free=int(39e9), where="cuda:0")
    with pytest.raises(ConfigError, match=r"19.3 GB in bfloat16 .* 10.0 GB free: use "
                                          r"--data_loader_config lowmem") as e:
        check_fits(half, free=int(10e9), where="cuda:0")
    assert "device_volume_dtype" not in str(e.value).split("use ")[1]
    # A batch's working memory counts too: 64 crops of 64^3, float32 crops and the int64 index.
    batch = VolumeNeed(sides=(64,), channels=(4, 5), batch=64, size=64)
    assert batch.batch_bytes() == 64 * 64**3 * (9 * 4 + 8)
    assert free_memory(CPU) > 0  # MemAvailable on Linux


def test_volumes_that_do_not_fit_stop_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """Through train.run: exit 2, one line, before anything is loaded or trained; the data is
    untouched and no run directory is left behind (the failed start removes the one it claimed;
    the line is on stderr, where a Slurm job's .out file gets it)."""
    root = write_cosmo_pair(tmp_path / "cosmo", side=32)
    cfg = build_config(UNET_YAML, "quickstart", {
        "data_root": root, "expdir": str(tmp_path / "logs"), "data_loader_config": "device",
        "synthesize_if_missing": "false", "base_width": "4", "max_width": "16",
        "num_iters": "2"})
    monkeypatch.setattr(device_loader, "free_memory", lambda device: 1_000_000)
    loaded = []
    monkeypatch.setattr(device_loader, "load_field", lambda *a: loaded.append(a))
    before = file_digests(root)
    with pytest.raises(SystemExit) as e:
        train_script.run(cfg)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data_loader_config=device: "), lines
    assert "cpu has 1.0 MB free" in lines[0] and "--device_volume_dtype bfloat16" in lines[0]
    assert "--data_loader_config lowmem" in lines[0]
    assert not loaded and file_digests(root) == before
    assert not os.path.exists(tmp_path / "logs")


def test_vit_with_the_device_loader_is_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises(ConfigError, match="use --data_loader_config lowmem or inmem"):
        build_config(VIT_YAML, "quickstart", {"data_loader_config": "device",
                                              "expdir": str(tmp_path)})
    with pytest.raises(SystemExit) as e:
        from_argv(["--data_loader_config", "device", "--expdir", str(tmp_path)], VIT_YAML)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: data_loader_config=device holds the U-Net's")


def test_batches_on_the_device_are_not_copied_by_to_device(cosmo20, tmp_path):
    """``Trainer.to_device`` hands a batch already on the device on as the same tensors."""
    cfg = unet_cfg(cosmo20, tmp_path, "device")
    dev = build_loaders(cfg, 1, 0, 3, CPU)
    x, y = next(iter(dev.train))
    fake = types.SimpleNamespace(device=CPU, task=make_task(cfg),
                                 memory_format=torch.contiguous_format)
    x1, y1 = train_script.Trainer.to_device(fake, x, y)
    assert x1 is x and y1 is y


def losses(text):
    return (re.findall(r"Avg train loss=(\S+)", text), re.findall(r"Avg val loss=(\S+)", text))


def test_training_with_the_device_loader_equals_lowmem(tmp_path):
    """train.py end to end: the same losses as lowmem (same batches), and the throughput report
    (IO / SYNTHETIC / FULL over the device loader) works."""
    root = write_cosmo_pair(tmp_path / "cosmo", side=40)
    common = TINY_UNET + ["--data_root", root, "--num_epochs", "2", "--Nsamples", "16",
                          "--Nsamples_val", "6", "--num_data_workers", "0"]
    low = train(common + ["--expdir", str(tmp_path / "low")])
    dev = train(common + ["--expdir", str(tmp_path / "dev"), "--data_loader_config", "device",
                          "--throughput_report"])
    assert "Device loader: training and validation volumes (4 + 5 channels of 40^3 and 40^3) " \
           "held on cpu in float32" in dev.stdout
    (train_low, val_low), (train_dev, val_dev) = losses(low.stdout), losses(dev.stdout)
    assert len(train_low) == len(val_low) == 2
    assert (train_dev, val_dev) == (train_low, val_low)
    final = [torch.load(os.path.join(run_dir(str(tmp_path / d)), "checkpoints",
                                     "ckpt_00000004.pt"), weights_only=True)["model"]
             for d in ("low", "dev")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # the same weights
    report = os.path.join(run_dir(str(tmp_path / "dev")), "throughput.json")
    assert os.path.exists(report) and '"data_loader_config": "device"' in open(report).read()


def test_graph_trainer_copies_device_batches_into_its_static_buffers(tmp_path):
    """train_graph.py's step (its CPU stand-in for the CUDA graph, as in test_cuda_graph.py)
    copies each device-loader batch into its static buffers: the losses equal train.py's with
    lowmem, step for step, through warm-up, capture and replays."""
    from test_cuda_graph import NotingGraphTrainer, NotingTrainer, ReplayOnCPU

    root = write_cosmo_pair(tmp_path / "cosmo", side=40)
    over = dict(zip(TINY_UNET[::2], TINY_UNET[1::2]))
    over = {k.lstrip("-"): v for k, v in over.items() if k not in ("--yaml_config", "--config")}
    over.update(data_root=root, num_iters="6", num_epochs=None, Nsamples="24", Nsamples_val="4",
                num_data_workers="0")

    def run(cls, mode, **kw):
        cfg = build_config(UNET_YAML, "quickstart", dict(over, data_loader_config=mode,
                                                         expdir=str(tmp_path / mode)))
        tr = cls(cfg, setup_runtime(cfg), **kw)
        tr.fit()
        return tr

    eager = run(NotingTrainer, "lowmem")
    graph = run(NotingGraphTrainer, "device", ops=ReplayOnCPU())
    assert graph.step_graph.captured and graph.step_graph.ops.replays == 6 - 3
    torch.testing.assert_close(graph.losses, eager.losses, rtol=1e-5, atol=1e-7)
