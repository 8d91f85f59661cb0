"""The pooled batch loader (datapipe/batch_pool.py): batches equal the datasets' reads, a batch
stays valid for as long as it is referenced while the pool reuses the buffers of released ones
(and, pinned, only after the device has passed its release), passes end and resume exactly,
worker errors and deaths arrive as one line, and nothing is left in /dev/shm."""
import gc
import multiprocessing
import os
import signal
import time

import h5py
import numpy as np
import pytest
import torch

from conftest import ROOT, write_era5
from loader_harness import Deadline, KeyedDataset, alive, deadline, shm_names
from datapipe.batch_pool import (BatchLoader, BatchPool, HostMemory, LoaderWorkerDied,
                              PinnedHostMemory, SlotLayout)
from settings.parse import build_config
from datapipe.cosmo_data import CosmoCropDataset
from datapipe.data_loader import ShardedSampler, ValidationSampler, build_loaders
from engine.checkpoint import RunFinished
from settings.errors import DataError, TrainingError, UserError

CPU = torch.device("cpu")


def loaders(kind, root, tmp_path, mode="lowmem", workers=0, **over):
    if kind == "vit":
        cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                           {"data_root": root, "expdir": str(tmp_path), "img_size": "[16,32]",
                            "data_loader_config": mode, "limit_nsamples_val": "6",
                            "num_data_workers": str(workers), **over})
    else:
        cfg = build_config(f"{ROOT}/config/UNet.yaml", "quickstart",
                           {"data_root": root, "Nsamples": "20", "Nsamples_val": "6",
                            "data_loader_config": mode, "num_data_workers": str(workers),
                            **over})
        cfg.data_size = 8  # crops of the 16^3 fixture box
    return build_loaders(cfg, 1, 0, 4, CPU)


def expected(loader, keys):
    """The batch of ``keys`` read by the dataset itself into fresh arrays."""
    sx, sy = loader.dataset.sample_shapes
    x = np.empty((len(keys), *sx), np.float32)
    y = np.empty((len(keys), *sy), np.float32)
    loader.dataset.read_batch(keys, x, y)
    return torch.from_numpy(x), torch.from_numpy(y)


def batch_keys(sampler, b=4):
    keys = list(sampler)
    return [keys[i:i + b] for i in range(0, len(keys), b)]


@pytest.fixture
def roots(tmp_path):
    from conftest import write_cosmo_pair

    return {"vit": write_era5(str(tmp_path / "era5")),
            "unet": write_cosmo_pair(tmp_path / "cosmo")}


# ----------------------------------------------------------------------------- same batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["lowmem", "inmem"])
@pytest.mark.parametrize("kind", ["vit", "unet"])
def test_batches_equal_the_datasets_reads(roots, tmp_path, kind, mode, workers):
    """Three epochs of training batches and two validations (the last batch partial) equal the
    dataset's ``read_batch`` of the sampler's keys; the engine's way of iterating (one batch at
    a time) never makes the pool grow past its depth, and the buffers are reused."""
    ld = loaders(kind, roots[kind], tmp_path, mode, workers)
    seen = set()
    for epoch in range(3):
        ld.train_sampler.set_epoch(epoch)
        want = batch_keys(ld.train_sampler)
        n = 0
        for (x, y), keys in zip(ld.train, want, strict=True):
            ex, ey = expected(ld.train, keys)
            assert torch.equal(x, ex) and torch.equal(y, ey)
            seen.add(x.data_ptr())
            n += 1
        assert n == len(ld.train) == len(want) >= 4
        for (x, y), keys in zip(ld.valid, batch_keys(ld.valid.sampler), strict=True):
            ex, ey = expected(ld.valid, keys)
            assert torch.equal(x, ex) and torch.equal(y, ey)
        assert [len(k) for k in batch_keys(ld.valid.sampler)] == [4, 2]
    assert len(ld.train.pool.slots) <= ld.train.depth == 2 * workers + 2
    assert len(seen) <= ld.train.depth  # 15+ batches in at most depth buffers
    ld.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_continues_exactly(roots, tmp_path, workers):
    """set_epoch(e, start_step) gives the batches of the uninterrupted epoch from that step on,
    also after a pass abandoned in the middle (its queued batches dropped, its buffers back)."""
    ld = loaders("vit", roots["vit"], tmp_path, workers=workers)
    ld.train_sampler.set_epoch(2)
    whole = [(x.clone(), y.clone()) for x, y in ld.train]
    ld.train_sampler.set_epoch(5)
    for i, _ in enumerate(ld.train):  # abandoned after 2 batches, with batches in flight
        if i == 1:
            break
    for start in (1, 3):
        ld.train_sampler.set_epoch(2, start)
        got = list(ld.train)
        assert len(got) == len(whole) - start
        assert all(torch.equal(x, a) and torch.equal(y, b)
                   for (x, y), (a, b) in zip(got, whole[start:]))
    assert not ld.train.in_flight
    ld.close()


# ----------------------------------------------------------------------------- held batches


@pytest.mark.parametrize("workers", [0, 2])
def test_a_held_batch_does_not_change(roots, tmp_path, workers):
    """A batch kept by the consumer (a view of it, or a NumPy array made from it) is not
    written over while many more are fetched, in this pass and the next: the pool grows by the
    batches held instead; once let go, a buffer is reused."""
    ld = loaders("unet", roots["unet"], tmp_path, workers=workers)
    train = ld.train
    ld.train_sampler.set_epoch(0)
    it = iter(train)
    x, y = next(it)
    want = x.clone(), y.clone()
    tail, arr = x[1:], y.numpy()  # a view and an array: the batch tensors themselves go
    del x, y
    for _ in range(4):
        next(it)
    ld.train_sampler.set_epoch(1)
    for _ in train:  # a whole pass more, with prefetching
        pass
    assert torch.equal(tail, want[0][1:]) and np.array_equal(arr, want[1].numpy())
    assert len(train.pool.slots) <= train.depth + 1  # the held batch's buffer, out of use
    kept = list(train)  # every batch of a pass held at once: all distinct and right
    assert len({x.data_ptr() for x, _ in kept}) == len(kept)
    for (x, y), keys in zip(kept, batch_keys(ld.train_sampler), strict=True):
        ex, ey = expected(train, keys)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    grown = len(train.pool.slots)
    del tail, arr, kept
    again = list(train)  # the buffers let go are used again: the pool does not grow
    assert len(train.pool.slots) == grown and len(again) == len(train)
    ld.close()


def test_the_engine_and_the_throughput_report_keep_their_batches(roots, tmp_path):
    """Used as train.py (one batch at a time, validation moving each batch to
    the device) and the throughput report (a batch cached from an abandoned pass, then fresh
    passes) use loaders: every batch is right when used, the cached one stays right."""
    ld = loaders("unet", roots["unet"], tmp_path, workers=2)
    ld.train_sampler.set_epoch(9)
    cached = next(iter(ld.train))  # throughput_report: cached = to_device(*next(pass))
    want = cached[0].clone()
    for epoch in range(2):
        ld.train_sampler.set_epoch(epoch)
        for (x, y), keys in zip(ld.train, batch_keys(ld.train_sampler)):
            x, y = x.to(CPU, non_blocking=True), y.to(CPU, non_blocking=True)
            assert torch.equal(x, expected(ld.train, keys)[0])
        for x, y in ld.valid:
            x, y = x.to(CPU), y.to(CPU)
        assert torch.equal(cached[0], want)
    assert len(ld.train.pool.slots) <= ld.train.depth + 1  # + the cached batch's buffer
    ld.close()


# ----------------------------------------------------------------------------- pinned memory


class FakeRuntime:
    """cudaHostRegister / cudaHostUnregister stand-ins: what was registered, and when."""

    def __init__(self, fail=0):
        self.fail, self.calls = fail, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's spelling
        self.calls.append(("register", ptr, size, flags))
        return self.fail

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


class FakePinnedMemory(PinnedHostMemory):
    """Pinned memory whose marks (CUDA events) complete when the test says so (or when waited
    for)."""

    def __init__(self, runtime, log):
        super().__init__(CPU, runtime=runtime)
        self.log, self.marks = log, []

    def mark(self):
        mark = {"done": False, "n": len(self.marks)}
        self.marks.append(mark)
        return mark

    def passed(self, mark):
        return mark["done"]

    def wait(self, mark):
        self.log.append(("wait", mark["n"]))
        mark["done"] = True

    def wait_all(self):
        self.log.append(("wait all",))
        for m in self.marks:
            m["done"] = True


def pinned_loader(root, workers=0, fail=0):
    runtime = FakeRuntime(fail)
    memory = FakePinnedMemory(runtime, runtime.calls)
    ds = CosmoCropDataset(os.path.join(root, "train.h5"), size=8, nsamples=40,
                          nbody_vector_channels=(1, 2, 3), hydro_vector_channels=(2, 3, 4))
    sampler = ShardedSampler(40, 4, 4, 0, shuffle=False)
    return BatchLoader(ds, sampler, 4, workers=workers, prefetch_depth=1, memory=memory), runtime


def slot_of(loader, x):
    return next(s.index for s in loader.pool.slots if s.address == x.data_ptr())


def test_pinned_slots_are_registered_once_and_reused_after_their_mark(roots):
    """Everything of the GPU path but the CUDA calls: each slot registered once, in place
    (cudaHostRegisterPortable); a released batch's slot waits for the mark taken at its release
    (a fetch that needs it waits for that mark, a prefetch does not); close waits for the device,
    then unregisters every slot."""
    ld, rt = pinned_loader(roots["unet"])
    events = ld.memory
    assert ld.pin_memory and ld.depth == 3
    it = iter(ld)
    b0, b1 = next(it), next(it)
    s0 = slot_of(ld, b0[0])
    del b0
    b2 = next(it)  # b0 released now: mark 0, not passed; a third slot is made
    assert len(events.marks) == 1 and len(ld.pool.slots) == 3
    s1 = slot_of(ld, b1[0])
    del b1
    b3 = next(it)  # b1 released (mark 1); every slot taken: waits for mark 0, reuses b0's slot
    assert ("wait", 0) in rt.calls and ("wait", 1) not in rt.calls
    assert slot_of(ld, b3[0]) == s0
    events.marks[1]["done"] = True  # the device passed b1's release
    del b2
    b4 = next(it)
    assert slot_of(ld, b4[0]) == s1 and ("wait", 1) not in rt.calls
    for b, keys in ((b3, [(0, i) for i in range(12, 16)]), (b4, [(0, i) for i in range(16, 20)])):
        assert torch.equal(b[0], expected(ld, keys)[0]) and torch.equal(b[1], expected(ld, keys)[1])
    registered = [c for c in rt.calls if c[0] == "register"]
    assert [c[1:] for c in registered] == [(s.address, s.layout.nbytes, 1) for s in ld.pool.slots]
    addresses = [s.address for s in ld.pool.slots]
    ld.close()
    after = rt.calls[rt.calls.index(("wait all",)):]
    assert sorted(c[1] for c in after if c[0] == "unregister") == sorted(addresses)
    assert torch.equal(b4[0], expected(ld, [(0, i) for i in range(16, 20)])[0])  # still valid


def test_a_prefetch_does_not_wait_for_the_device():
    log = []
    memory = FakePinnedMemory(FakeRuntime(), log)
    pool = BatchPool(SlotLayout((2, 3), (2, 1)), memory, depth=2)
    a, b = pool.take(), pool.take()
    held = [pool.hand_out(a, 2), pool.hand_out(b, 2)]
    del held
    assert pool.take(urgent=False) is None and not log  # released, mark not passed: later
    assert pool.take(urgent=True) is a and log == [("wait", 0)]
    pool.close()


def test_a_failed_registration_says_so(roots):
    ld, _ = pinned_loader(roots["unet"], fail=2)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of a .* MiB batch buffer failed "
                                           r"with cudaError 2"):
        next(iter(ld))
    ld.close()


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_and_release_after_the_copy_on_gpu(roots, workers):
    """On a GPU batches are page-locked in place (no copy to pin them) and a buffer is reused
    only once the asynchronous copy from it is done: with the device kept busy before each copy,
    the host runs ahead and the pool must wait for the copies, and every copy is right."""
    device = torch.device("cuda")
    ds = CosmoCropDataset(os.path.join(roots["unet"], "train.h5"), size=8, nsamples=64,
                          nbody_vector_channels=(1, 2, 3), hydro_vector_channels=(2, 3, 4))
    sampler = ShardedSampler(64, 4, 4, 0, shuffle=False)
    ld = BatchLoader(ds, sampler, 4, workers=workers, prefetch_depth=1,
                     memory=PinnedHostMemory(device))
    copies = []
    for x, y in ld:
        assert x.is_pinned() and y.is_pinned()
        torch.cuda._sleep(20_000_000)  # device time queued ahead of the copy
        copies.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
    torch.cuda.synchronize()
    for (x, y), keys in zip(copies, batch_keys(sampler), strict=True):
        ex, ey = expected(ld, keys)
        assert torch.equal(x.cpu(), ex) and torch.equal(y.cpu(), ey)
    assert len(ld.pool.slots) <= ld.depth  # the host waited for the copies instead of growing
    held = next(iter(ld))
    ld.close()  # unregistered (after a device synchronisation); a held batch stays readable
    assert torch.equal(held[0], expected(ld, batch_keys(sampler)[0])[0])


# ----------------------------------------------------------------------------- errors, ends


def test_a_worker_error_arrives_as_one_line(tmp_path):
    """A data error in a worker is raised in the main process as itself, its one-line message;
    a bug as a RuntimeError with the worker's traceback."""
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 2, 2] = np.nan
    ld = loaders("vit", root, tmp_path, workers=2)
    ld.train_sampler.set_epoch(0)
    with pytest.raises(DataError) as e:
        list(ld.train)
    msg = str(e.value)
    assert "\n" not in msg and "Caught" not in msg and "loader worker" not in msg
    assert msg.startswith("non-finite values in ") and "2017.h5" in msg
    ld.close()

    ld = loaders("unet", write_cosmo_root(tmp_path), tmp_path, workers=2)
    ds = ld.train.dataset

    def broken(keys, x, y):
        raise ValueError("a bug")

    ds.read_batch = broken  # the workers are forked at the first pass: they have it too
    with pytest.raises(RuntimeError, match=r"(?s)Caught ValueError in loader worker \d .*"
                                           r"Traceback.*ValueError: a bug"):
        next(iter(ld.train))
    ld.close()  # the workers were forked with the broken method: new ones
    del ds.read_batch
    assert len(list(ld.train)) == len(ld.train)
    ld.close()


def write_cosmo_root(tmp_path):
    from conftest import write_cosmo_pair

    return write_cosmo_pair(tmp_path / "cosmo_b")


def test_a_killed_worker_ends_the_pass_with_one_line_and_nothing_left(roots, tmp_path):
    """A worker killed (SIGKILL) in the middle of an epoch: the next fetch raises the one-line
    LoaderWorkerDied (a TrainingError: train.py prints it as ``error: ...``), the other worker
    is ended too, and no file is left in /dev/shm (the buffers are anonymous memory); a new
    pass starts fresh workers."""
    before = shm_names()
    children = set(multiprocessing.active_children())
    ld = loaders("unet", roots["unet"], tmp_path, workers=2, Nsamples="40", prefetch_depth="1")
    ld.train_sampler.set_epoch(0)
    it = iter(ld.train)
    next(it)
    for slot in ld.train.pool.slots:  # each buffer is anonymous shared memory, in no directory
        (line,) = [m for m in open("/proc/self/maps")
                   if int(m.split("-")[0], 16) == slot.address]
        assert "/memfd:batch-slot" in line and "/dev/shm" not in line
    pids = [w.process.pid for w in ld.train.workers]
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(LoaderWorkerDied) as e:
        for _ in it:
            pass
    assert isinstance(e.value, TrainingError) and isinstance(e.value, UserError)
    msg = str(e.value)
    assert "\n" not in msg and f"worker 1 (pid {pids[1]}) was killed by SIGKILL" in msg
    assert set(multiprocessing.active_children()) <= children  # both workers gone
    assert shm_names() <= before
    assert len(list(ld.train)) == len(ld.train)  # fresh workers
    ld.close()
    assert shm_names() <= before


@pytest.mark.parametrize("workers", [2, 8])
def test_a_new_pass_after_one_abandoned_with_batches_complete(workers):
    """A pass abandoned while later batches of it are complete (every part answered while the
    first batch was awaited: a batch of 4 is shared by 4 of 8 workers) hands over to the next
    pass at once: ending it waits only for parts still outstanding."""
    slow_first = KeyedDataset(32, delay=lambda keys: 0.3 if 0 in keys else 0.0)
    ld = BatchLoader(slow_first, list(range(32)), 4, workers=workers)
    x, y = next(iter(ld))
    assert KeyedDataset.keys_of(x, y) == [0, 1, 2, 3]
    try:
        with deadline(5, "iter() after a pass abandoned with complete batches"):
            it = iter(ld)
    except Deadline:
        ld.close()
        raise
    got = [KeyedDataset.keys_of(x, y) for x, y in it]
    assert got == [list(range(i, i + 4)) for i in range(0, 32, 4)]
    assert not ld.in_flight
    ld.close()


@pytest.mark.parametrize("workers", [0, 1, 2, 8])
def test_training_then_the_throughput_report_finishes_20_of_20_times(tmp_path, workers):
    """The shape of the run that once hung (a batch of 4, 8 workers, training and validation,
    then the throughput report's pass abandoned after one batch and fresh passes): in process,
    one tiny run to its end, then its report's passes 19 times more, each within a deadline.
    16 samples: passes of 4 batches, which the report abandons after one (its cached batch) and
    before their last (its rounds: 2 warm-up batches, 1 timed, 1 fetched ahead); with 8 workers
    (2 batches each in flight) the whole pass is in flight from its start, as it was with 32."""
    from engine import throughput_report as tp
    from engine.runtime import setup_runtime
    from test_throughput_report import tiny_vit_cfg
    from train import Trainer

    data = write_era5(str(tmp_path / "era5"), steps=20, h=8, w=16)
    cfg = tiny_vit_cfg(data, str(tmp_path / "exp"), num_iters=4, limit_nsamples=16,
                       limit_nsamples_val=8, img_size="[8,16]", embed_dim=8, num_heads=1,
                       num_data_workers=workers, throughput_report="true", enable_fused="true",
                       amp_mode="none", checkpoint_every=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model is tiny: the loader's hand-overs are what is tested
    tr = Trainer(cfg, setup_runtime(cfg))
    try:
        with deadline(60, f"the run with {workers} workers"):
            tr.fit()
        for i in range(19):
            with deadline(30, f"the throughput report's passes, time {i + 2}, {workers} workers"):
                tp.measure(tr)
    finally:
        torch.set_num_threads(threads)
        tr.loaders.close()


def test_the_first_training_pass_is_begun_before_the_model_is_built(tmp_path, monkeypatch):
    """The trainer builds its loaders before its model and begins the run's first training pass
    there, at the position a resume takes up: the workers have the first batches to read while
    the model is built, and the first epoch takes that pass. A run with nothing left to do
    begins none."""
    import train
    from engine.runtime import setup_runtime
    from test_throughput_report import tiny_vit_cfg

    events = []
    send_ahead = BatchLoader._send_ahead

    def noting_send_ahead(self, p):
        send_ahead(self, p)
        events.append(("sent", len(self.in_flight)))

    make_task = train.make_task

    def noting_make_task(cfg):
        task = make_task(cfg)
        build_model = task.build_model
        task.build_model = lambda: events.append(("model", 0)) or build_model()
        return task

    monkeypatch.setattr(BatchLoader, "_send_ahead", noting_send_ahead)
    monkeypatch.setattr(train, "make_task", noting_make_task)
    data = write_era5(str(tmp_path / "era5"), steps=20, h=16, w=32)
    exp = str(tmp_path / "exp")

    def trainer(num_iters, **kw):  # 32 samples in batches of 4: 8 steps an epoch
        cfg = tiny_vit_cfg(data, exp, num_iters=num_iters, limit_nsamples=32,
                           limit_nsamples_val=8, num_data_workers=2, checkpoint_every=6, **kw)
        events.clear()
        return train.Trainer(cfg, setup_runtime(cfg))

    step6 = os.path.join(exp, "quickstart", "1", "0", "checkpoints", "ckpt_00000006.pt")
    for num_iters, kw, position in ((8, {}, (0, 0)), (10, {"resume_from": step6}, (0, 6))):
        tr = trainer(num_iters, **kw)
        try:
            model = events.index(("model", 0))
            assert model > 0 and events[0][0] == "sent" and events[0][1] > 0, events
            epoch, first, _, begun = tr.loaders._begun
            assert (epoch, first) == position == (tr.state.epoch, tr.state.step_in_epoch)
            tr.fit()
            assert tr.loaders._begun is None  # taken by the first epoch, whose steps it served
            assert begun.served >= min(8, num_iters) - first > 0
        finally:
            tr.loaders.close()
    with pytest.raises(RunFinished):  # the resumed run, finished: no loader is even made
        trainer(10, resume="true", run_num=1)


def test_a_begun_pass_is_taken_once_and_only_at_its_position(tmp_path):
    data = write_era5(str(tmp_path / "era5"), steps=20, h=16, w=32)
    for workers in (0, 2):
        ld = loaders("vit", data, tmp_path, workers=workers)
        try:
            ld.begin_training_pass(1, 2)
            assert (ld.train_sampler.epoch, ld.train_sampler.start_step) == (1, 2)
            if workers:
                assert ld.train.in_flight  # sent to the workers before the first next()
            assert ld.begun_training_pass(1, 3) is None and ld.begun_training_pass(1, 2) is None
            ld.begin_training_pass(1, 2)
            begun = ld.begun_training_pass(1, 2)
            keys = batch_keys(ld.train_sampler)
            for got, k in zip(begun, keys):
                torch.testing.assert_close(got, expected(ld.train, k), rtol=0, atol=0)
            assert begun.served == len(keys) and ld.begun_training_pass(1, 2) is None
            ld.begin_training_pass(1, 2)
            train, ld.train = ld.train, iter([])  # replaced (a test's wrapper): not its pass
            assert ld.begun_training_pass(1, 2) is None
            ld.train = train
        finally:
            ld.close()


PARENT = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from datapipe.batch_pool import BatchLoader
from loader_harness import KeyedDataset
ld = BatchLoader(KeyedDataset(64, delay=lambda keys: 0.001), list(range(64)), 4, workers=2)
for i in range(10**6):
    for j, _ in enumerate(ld):
        if i == 0 and j == 0:
            print("ready", flush=True)
        if j == i % 5:
            break
    if i % 3 == 0:
        ld.close()  # new workers forked at the next pass: the parent may die while forking
"""


def in_session(sid: int) -> list[int]:
    """The live processes of session ``sid``: a parent started in a session of its own and all it
    forked (its workers start no session)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(") ", 1)[1].split()[3]) == sid and alive(int(pid)):
                    found.append(int(pid))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return found


def test_workers_die_with_their_parent(tmp_path):
    """A training process killed (SIGKILL) at random moments, while it iterates, abandons passes
    and forks new workers: every worker it forked is gone within a second. The parent is forked
    from the preloaded server (tests/preloaded.py), in a session of its own that marks it and all
    it forks."""
    import random
    import subprocess
    import sys

    import preloaded

    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for trial in range(6):
        parent = preloaded.Popen([sys.executable, str(script)], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert parent.stdout.readline() == "ready\n"
            # The mark finds the parent and its 2 workers (seen once: the parent replaces its
            # workers every few passes, so at a given moment one may be starting or gone).
            seen, end = 0, time.monotonic() + 10
            while seen < 3 and time.monotonic() < end:
                seen = max(seen, len(in_session(parent.pid)))
            assert seen >= 3, f"trial {trial}: {seen} processes in the parent's session"
            time.sleep(random.uniform(0, 0.3))
        finally:  # never left running, whatever failed above
            parent.kill()
            parent.wait()
            parent.stdout.close()
        end = time.monotonic() + 1.0
        while in_session(parent.pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert not in_session(parent.pid), f"trial {trial}: workers outlived their parent"


def test_workers_are_started_from_the_main_thread():
    """A worker dies with the thread that forked it: a first pass in another thread says so."""
    import threading

    ld = BatchLoader(KeyedDataset(8), list(range(8)), 4, workers=1)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, list, ld)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0].value)
    assert KeyedDataset.keys_of(*next(iter(ld))) == [0, 1, 2, 3]  # from the main thread: works
    ld.close()


def test_a_fetch_interrupted_by_a_signal_handler_and_what_it_waited_for():
    """A signal handler raises while ``next()`` waits (the engine's stop request or stall
    timeout): ``waiting_for()``, called in the handler, says in one line which pass and batch,
    which workers and which parts; the pass ends there; ``close()`` ends the workers, a new pass
    serves the right batches; a dead worker is named as such."""
    ld = BatchLoader(KeyedDataset(16, delay=lambda keys: 0.5 if 4 in keys else 0.0),
                     list(range(16)), 4, workers=2, prefetch_depth=1)
    it = iter(ld)
    assert KeyedDataset.keys_of(*next(it)) == [0, 1, 2, 3]
    said = []

    def stall(signum, frame):
        said.append(ld.waiting_for())
        raise Deadline("stalled")

    previous = signal.signal(signal.SIGALRM, stall)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(Deadline):
            next(it)
    finally:
        signal.signal(signal.SIGALRM, previous)
    pids = [w.process.pid for w in ld.workers]
    (line,) = said
    assert line.startswith(f"batch loader: pass 1 waits for batch 1; workers alive: pids "
                           f"{pids[0]}, {pids[1]}; dead: none; parts outstanding: worker 0 "
                           f"(pid {pids[0]}) batch 1:1 rows 0:2 keys 4..5"), line
    assert "\n" not in line and ld.waiting_for() == line  # still what the wait was for
    with pytest.raises(StopIteration):
        next(it)  # the interrupted pass ended
    t0 = time.perf_counter()
    ld.close()
    assert time.perf_counter() - t0 < 2 and not [p for p in pids if alive(p)]
    assert [KeyedDataset.keys_of(x, y) for x, y in ld] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                            [8, 9, 10, 11], [12, 13, 14, 15]]
    victim = ld.workers[1].process
    os.kill(victim.pid, signal.SIGKILL)
    while alive(victim.pid):
        time.sleep(0.01)
    assert f"dead: {victim.pid} (worker 1)" in ld.waiting_for()
    ld.close()


def test_close_ends_workers_at_once_and_held_batches_stay(roots, tmp_path):
    before = shm_names()
    children = set(multiprocessing.active_children())
    ld = loaders("vit", roots["vit"], tmp_path, workers=2)
    ld.train_sampler.set_epoch(0)
    it = iter(ld.train)
    x, _ = next(it)
    want = x.clone()
    next(ld.valid.__iter__())
    t0 = time.perf_counter()
    ld.close()
    assert time.perf_counter() - t0 < 2
    assert set(multiprocessing.active_children()) <= children
    assert torch.equal(x, want)  # the buffer's memory lives as long as the batch
    assert shm_names() <= before


def test_a_failed_run_through_train_py_says_one_line(tmp_path, capsys):
    """A loader worker killed during training: train.py ends with one ``error:`` line and exit
    1, no traceback; its workers end and /dev/shm holds nothing new. A finished run likewise
    leaves nothing there."""
    import train
    from settings.cli import from_argv

    root = write_era5(str(tmp_path / "e"), steps=20)
    args = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
            "--num_heads", "2", "--global_batch_size", "4", "--synthesize_if_missing", "false",
            "--data_root", root, "--num_data_workers", "2", "--checkpoint_every", "0"]
    before = shm_names()
    children = set(multiprocessing.active_children())
    train.run(from_argv(args + ["--num_iters", "6", "--expdir", str(tmp_path / "ok")]))
    assert set(multiprocessing.active_children()) <= children and shm_names() <= before

    class Killing(train.Trainer):
        def train_step(self, *a, **kw):
            if self.iteration == 3:
                os.kill(self.loaders.train.workers[0].process.pid, signal.SIGKILL)
            return super().train_step(*a, **kw)

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.run(from_argv(args + ["--num_iters", "30", "--expdir", str(tmp_path / "bad")]),
                  trainer_cls=Killing)
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert err.strip().splitlines()[-1].startswith("error: data loader worker 0 (pid "), err
    assert "killed by SIGKILL" in err and "Traceback" not in err
    assert set(multiprocessing.active_children()) <= children and shm_names() <= before


def test_validation_sampler_shards_keep_their_order(roots, tmp_path):
    """Each data-parallel rank's validation loader serves its contiguous shard, in order."""
    ld = loaders("vit", roots["vit"], tmp_path, workers=2)
    for rank in range(2):
        sampler = ValidationSampler(6, 2, rank)
        loader = BatchLoader(ld.valid.dataset, sampler, 2, workers=2)
        for (x, _), keys in zip(loader, batch_keys(sampler, 2), strict=True):
            assert torch.equal(x, expected(loader, keys)[0])
        loader.close()
    ld.close()


def test_default_memory_is_host_memory():
    assert not HostMemory().pinned


def test_buffers_under_a_file_size_limit(roots, tmp_path):
    """Shared buffers are (anonymous) files, so the file-size limit (ulimit -f) applies to them:
    with workers a buffer over it is refused in one line that names the limit; without workers
    the buffers are the process's own memory and the limit does not matter."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    workers = loaders("vit", roots["vit"], tmp_path, workers=2)
    alone = loaders("vit", roots["vit"], tmp_path, workers=0)
    for ld in (workers, alone):
        ld.train_sampler.set_epoch(0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, hard))
    try:
        with pytest.raises(TrainingError, match=r"could not allocate a .* MiB batch buffer in "
                                                r"shared memory \(File too large\) \(.*ulimit -f"):
            next(iter(workers.train))
        x, y = next(iter(alone.train))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert torch.equal(x, expected(alone.train, batch_keys(alone.train_sampler)[0])[0])
    workers.close()
    alone.close()


class _Finalised:
    """Garbage that says where its finaliser ran: a file named by that process's id."""

    def __init__(self, marks):
        self.marks, self.cycle = marks, self  # a cycle: only the collector frees it

    def __del__(self):
        open(os.path.join(self.marks, str(os.getpid())), "w").close()


class _Collecting(KeyedDataset):
    def read_batch(self, keys, x, y):
        gc.collect()  # a full collection in the worker, as any allocation there may start one
        super().read_batch(keys, x, y)


def test_workers_never_finalise_what_they_inherit(tmp_path):
    """Garbage left in the main process when it forks the workers (a cycle with a finaliser, as
    a DALI pipeline's, whose shut-down crashed a worker that collected it) is finalised in the
    main process, never in a worker, though the workers collect garbage as they read."""
    enabled = gc.isenabled()
    gc.disable()  # nothing collected by chance before the workers start
    try:
        _Finalised(str(tmp_path))
        ld = BatchLoader(_Collecting(8), list(range(8)), 4, workers=2)
        got = [KeyedDataset.keys_of(x, y) for x, y in ld]
        pids = [w.process.pid for w in ld.workers]
        ld.close()
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert os.listdir(tmp_path) == [str(os.getpid())], (os.listdir(tmp_path), pids)
