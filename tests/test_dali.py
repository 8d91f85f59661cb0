"""DALI loaders on CPU pipelines (device_id=None): the same batches as the PyTorch loaders,
rotations with vector channels, sharding, resume, the hand-off to torch (streams, copies), the
missing-DALI message, and training runs; on a GPU (marked gpu) the hand-off on torch's stream."""
import builtins
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, write_cosmo_pair, write_era5
from test_training import TINY_UNET, TINY_VIT, baseline_and_val, train
from datapipe import dali_loader
from settings.parse import build_config
from datapipe.dali_loader import DALILoader, EpochKeys, Handoff, handoff
from datapipe.data_loader import build_loaders
from settings.errors import ConfigError
from datapipe.rotations import ROTATIONS, matrix

CPU = torch.device("cpu")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    datapipe.rotations says, and a constant vector field v becomes R v (not v, as a plain array
    rotation would leave it)."""
    from nvidia.dali import fn, pipeline_def

    from datapipe.dali_loader import _rotate, rotation_arguments
    from loader_harness import rotate_volume

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


# ---------------------------------------------------------------------- the hand-off to torch

def test_handoff_binds_gpu_batches_to_torchs_current_stream(monkeypatch):
    """On a GPU both the pipeline's outputs and the copy go on torch's current stream of the
    device (read when the batch is fetched), and the batch is copied; on CPU there is no stream
    and DALI's buffer is wrapped, unless the legacy executor will reuse it."""
    asked = []

    class FakeStream:  # what torch.cuda.current_stream returns; no GPU needed
        def __init__(self, device):
            self.device = device

    def current_stream(device=None):
        asked.append(device)
        return FakeStream(device)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    gpu = torch.device("cuda", 1)
    plan = handoff(gpu, exec_dynamic=True)
    assert isinstance(plan.stream, FakeStream) and plan.stream.device == gpu
    assert plan.run_stream is plan.stream and not plan.share
    legacy = handoff(gpu, exec_dynamic=False)  # run(stream) needs the dynamic executor
    assert isinstance(legacy.stream, FakeStream) and legacy.run_stream is None and not legacy.share
    assert asked == [gpu, gpu]
    assert handoff(CPU, exec_dynamic=True) == Handoff(None, None, share=True)
    assert handoff(CPU, exec_dynamic=False) == Handoff(None, None, share=False)
    assert asked == [gpu, gpu]  # CPU batches never touch CUDA


class FakeOutput:
    """A dense pipeline output (what ``as_tensor`` gives): its shape only."""

    def __init__(self, shape):
        self._shape = list(shape)

    def as_tensor(self):
        return self

    def shape(self):
        return self._shape


class FakePipe:
    """``runs`` batches of (x, y) shaped (2, 3) and (2, 1), then StopIteration; records the
    stream every ``run`` was given."""

    exec_dynamic = True

    def __init__(self, runs):
        self.runs, self.streams = runs, []

    def build(self):
        pass

    def run(self, cuda_stream=None):
        self.streams.append(cuda_stream)
        if len(self.streams) > self.runs:
            raise StopIteration
        return FakeOutput((2, 3)), FakeOutput((2, 1))


def test_loader_copies_each_output_once_on_the_handoff_stream(monkeypatch):
    """The loader passes the hand-off's stream to every ``pipe.run`` (the drain at the end of the
    epoch too) and to ``feed_ndarray``, which it calls once per output per batch: the only copy.
    The last batch is cut to the epoch's size."""
    stream = object()  # stands for torch's current stream
    monkeypatch.setattr(dali_loader, "handoff",
                        lambda device, exec_dynamic: Handoff(stream, stream, share=False))
    copies = []

    def feed(out, t, cuda_stream=None):
        copies.append((tuple(t.shape), cuda_stream))
        t.fill_(len(copies))
        return t

    pipe = FakePipe(runs=3)
    ld = DALILoader(lambda: pipe, list(range(5)), 2, EpochKeys(6), CPU, feed)
    got = list(ld)
    assert [(tuple(x.shape), tuple(y.shape)) for x, y in got] == [((2, 3), (2, 1))] * 2 + [((1, 3), (1, 1))]
    assert [(x.unique().item(), y.unique().item()) for x, y in got] == [(1, 2), (3, 4), (5, 6)]
    assert copies == [((2, 3), stream), ((2, 1), stream)] * 3
    assert len(pipe.streams) == 4 and all(s is stream for s in pipe.streams)


def spy_runs(loader, seen: list):
    """Record, for every ``pipe.run`` of ``loader``'s pipeline, its arguments and the addresses of
    its outputs."""
    make = loader.build_pipeline

    def build():
        pipe = make()
        run = pipe.run

        def spied(*args):
            outs = run(*args)
            seen.append((args, [o.as_tensor().data_ptr() for o in outs]))
            return outs

        pipe.run = spied
        return pipe

    loader.build_pipeline = build


@pytest.mark.parametrize("model", ["unet", "vit"])
@pytest.mark.parametrize("mode,workers", [("lowmem", 2), ("inmem", 0)])
def test_dali_cpu_batches_are_dalis_buffers_and_stay_valid(dali, cosmo_root, era5_root, model, mode,
                                                           workers):
    """On CPU a batch is DALI's output buffer itself (no copy: feed_ndarray is never called, the
    tensor's address is the output's), and each batch keeps its own buffer: batches held without
    a copy, while the pipeline produced the rest of the epoch and the next one, still equal the
    PyTorch loader's (a loader reusing buffers would have overwritten them)."""
    make = unet_cfg if model == "unet" else vit_cfg
    root = cosmo_root if model == "unet" else era5_root
    ref = build_loaders(make(root, mode, workers), 1, 0, 4, CPU)
    ld = build_loaders(make(root, f"dali-{mode}", workers), 1, 0, 4, CPU)

    def no_copy(*args, **kw):
        raise AssertionError("a CPU batch was copied")

    ld.train.feed = no_copy
    seen = []
    spy_runs(ld.train, seen)
    ld.train_sampler.set_epoch(0)
    held = list(ld.train)  # no clone
    n = len(held)
    assert n >= 3 and len(seen) == n
    assert [args for args, _ in seen] == [(None,)] * n  # no stream on CPU
    assert [[x.data_ptr(), y.data_ptr()] for x, y in held] == [ptrs for _, ptrs in seen]
    ld.train_sampler.set_epoch(1)
    batches(ld.train)
    ref.train_sampler.set_epoch(0)
    assert_same(held, batches(ref.train))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", ["unet", "vit"])
def test_dali_gpu_batches_arrive_on_torchs_current_stream(dali, cosmo_root, era5_root, model):
    """On a GPU, under a side stream: every ``pipe.run`` and every copy get that stream (no
    host-synchronous outputs), each output is copied once, and the batches equal the PyTorch
    loader's."""
    make = unet_cfg if model == "unet" else vit_cfg
    root = cosmo_root if model == "unet" else era5_root
    gpu = torch.device("cuda", torch.cuda.current_device())
    ref = build_loaders(make(root, "inmem"), 1, 0, 4, CPU)
    ld = build_loaders(make(root, "dali-inmem"), 1, 0, 4, gpu)
    seen, copies = [], []
    spy_runs(ld.train, seen)
    feed = ld.train.feed

    def recording_feed(out, t, cuda_stream=None):
        copies.append(cuda_stream)
        return feed(out, t, cuda_stream=cuda_stream)

    ld.train.feed = recording_feed
    side = torch.cuda.Stream(gpu)
    ld.train_sampler.set_epoch(0)
    with torch.cuda.stream(side):
        got = batches(ld.train)  # the clones are queued on the side stream too
    side.synchronize()
    assert len(got) >= 3 and len(seen) == len(got) and len(copies) == 2 * len(got)
    assert all(args[0].cuda_stream == side.cuda_stream for args, _ in seen)
    assert all(s.cuda_stream == side.cuda_stream for s in copies)
    ref.train_sampler.set_epoch(0)
    assert_same(got, [(x.to(gpu), y.to(gpu)) for x, y in batches(ref.train)])


# Run in a process of its own: run inside pytest's process, the worker's collection did not
# reach the abandoned pipeline, and the test passed without what it checks.
INHERITED_GARBAGE = """
import gc, sys
import torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_dali import unet_cfg, batches
from datapipe.cosmo_data import CosmoCropDataset
from datapipe.data_loader import build_loaders

gc.disable()  # nothing collected by chance in this process
first = build_loaders(unet_cfg({data!r}, "dali-lowmem", 1), 1, 0, 4, torch.device("cpu"))
next(iter(first.train))  # its pipeline built and run, its workers started
cycle = [first]
cycle.append(cycle)
del first, cycle  # garbage that only a collection frees
window = CosmoCropDataset.window
CosmoCropDataset.window = lambda self, *args: (gc.collect(), window(self, *args))[1]
got = batches(build_loaders(unet_cfg({data!r}, "dali-lowmem", 1), 1, 0, 4,
                            torch.device("cpu")).train)
print(len(got), "batches")
"""


def test_dali_workers_never_free_a_pipeline_they_inherit(dali, cosmo_root):
    """A pipeline left in the main process for the garbage collector (an interrupted pass drops
    its pipeline) is never freed in the Python workers of a pipeline built later, though they
    collect garbage as they read: freed there, its shut-down ran in a copy without DALI's
    threads, the worker died and the loader failed ("Worker data receiving interrupted")."""
    code = INHERITED_GARBAGE.format(root=ROOT, tests=os.path.join(ROOT, "tests"), data=cosmo_root)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "3 batches"


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


def test_dali_workers_ignore_the_stop_signals_and_their_errors_are_one_line(dali, era5_root):
    """The Python workers of a parallel source survive the run's stop signals (Slurm sends them
    to every process of the job step; the main process acts on them), and the epoch goes on; a
    DataError a worker raises reaches the engine as that DataError, not DALI's traceback."""
    import multiprocessing
    import signal
    import time

    import h5py

    from settings.errors import DataError
    cfg = vit_cfg(era5_root, "dali-lowmem", workers=2)
    want = batches(build_loaders(vit_cfg(era5_root, "lowmem"), 1, 0, 4, CPU).train)
    loader = build_loaders(cfg, 1, 0, 4, CPU).train
    earlier = {p.pid for p in multiprocessing.active_children()}  # (other tests' loaders)
    it = iter(loader)
    got = [tuple(t.clone() for t in next(it))]
    workers = [p for p in multiprocessing.active_children() if p.pid not in earlier]
    assert len(workers) == 2  # this pipeline's Python workers
    for w in workers:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # the default stop_signals
            os.kill(w.pid, sig)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers)
    got += [(x.clone(), y.clone()) for x, y in it]
    assert_same(got, want)

    with h5py.File(os.path.join(era5_root, "train", os.listdir(f"{era5_root}/train")[0]),
                   "r+") as f:
        f["fields"][0, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match=r"^non-finite values in .*: repair the file or remove "
                       r"it from"):
        for _ in build_loaders(cfg, 1, 0, 4, CPU).train:
            pass


def test_a_dropped_pipelines_worker_that_does_not_exit_is_killed(dali, era5_root, tmp_path,
                                                                 monkeypatch):
    """DALI stops a dropped pipeline's Python workers by a request through its queues, then by
    SIGTERM, which they ignore (above); a worker that does not take the request (here stuck in a
    read of a hung file system; or one whose request was lost in queues an interrupt left half
    updated) is killed instead of being waited for forever. The pipeline is dropped as after a
    stall timeout: interrupted while it waits for a batch."""
    import gc
    import multiprocessing
    import signal
    import time

    from datapipe.era5_data import ERA5Dataset
    from loader_harness import alive
    hang, stuck = tmp_path / "hang", tmp_path / "stuck"

    class Stalled(Exception):
        pass

    def stall_timeout(signum, frame):  # once the worker is in its hung read
        if stuck.exists():
            raise Stalled()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
    read = ERA5Dataset.__getitem__

    def hangs_when_told(self, key):  # in the worker
        if hang.exists():
            stuck.touch()
            time.sleep(3600)
        return read(self, key)

    monkeypatch.setattr(ERA5Dataset, "__getitem__", hangs_when_told)
    earlier = {p.pid for p in multiprocessing.active_children()}  # (other tests' loaders)
    loader = build_loaders(vit_cfg(era5_root, "dali-lowmem", workers=1), 1, 0, 4, CPU).train
    assert len(batches(loader)) == len(loader)
    [worker] = [p for p in multiprocessing.active_children() if p.pid not in earlier]
    previous = signal.signal(signal.SIGALRM, stall_timeout)
    try:
        hang.touch()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Stalled):
            batches(loader)
        assert loader.pipe is None
        gc.collect()  # DALI's finalizer of the dropped pipeline waits for its workers (a hang
        # here ends as tests/conftest.py's TEST_LIMIT_S says)
        assert not alive(worker.pid)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        worker.kill()
