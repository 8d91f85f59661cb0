"""A stateful stress test of the batch loaders: random sequences of what a consumer does, with
the loader's invariants (datapipe/batch_pool.py's module docstring) checked after every step.

The machine (Hypothesis's ``RuleBasedStateMachine``) drives a ``BatchLoader`` over a dataset
whose samples say their key (``loader_harness.KeyedDataset``), with 0, 1, 2 or 8 workers, a
batch smaller or larger than the number of workers and an uneven last batch. Its rules: start a
pass (``iter()``, which abandons the previous one part-way; or, as the throughput report does,
a pass for its first batch only and then another), fetch (``next()``), keep a batch or
let it go at once, let a kept batch go later, slow and jittered reads, a read that fails in a
worker, a worker killed with SIGKILL, an exception raised by a signal handler while ``next()`` or
``iter()`` waits (as the engine's stop request and stall timeout do), a consumer that takes its
time (the workers run ahead), and ``close()``. Every choice is drawn from fixed ranges and a rule
that does not apply does nothing, since what the loader does depends on timing; for the same
reason a failure is not shrunk (Hypothesis may report it as flaky: the error it wraps is the one).

Checked after every step: every batch holds exactly the samples of the keys it should (in the
sampler's order, the last batch short); a kept batch never changes; no step takes more than a
few seconds (a hang fails with the step and ``waiting_for()``, it does not hang the suite);
after ``close()`` no worker is left and nothing new is in /dev/shm; an iterator of an ended pass
stops. A smaller machine (start, fetch, keep, abandon, interrupt) runs against the device loader
and the DALI loader (CPU) with the same checks of their batches.

The default run takes about 40 s on 2 cores (50 sequences of up to 60 steps for the batch pool,
3,000 steps, and a few hundred for the others), the same sequences every time;
``BATCH_POOL_STRESS=long python -m pytest tests/test_batch_pool_stress.py`` draws twenty times as
many new ones (about a quarter of an hour).
"""
from __future__ import annotations

import collections
import contextlib
import mmap
import os
import random
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from loader_harness import KeyedDataset, alive, deadline, in_shm, shm_names, wait_gone
from datapipe.batch_pool import BatchLoader, LoaderWorkerDied

# An interrupt that lands in a finalizer run by the garbage collector is reported by Python as
# "Exception ignored" and lost (that fetch is then simply not interrupted): not a failure here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
LONG = os.environ.get("BATCH_POOL_STRESS") == "long"
STEP_SECONDS = 20  # a hang: a step takes milliseconds, and a DALI fetch took over 5 s at load 10
CPU = torch.device("cpu")
# Every choice is drawn from fixed ranges, and a rule that does not apply does nothing (no
# preconditions): what the loader does depends on timing, and Hypothesis requires the same
# choices to be drawn the same way in every run.
ANY = st.integers(0, 2**16)


def run_settings(examples: int, steps: int):
    scale = 20 if LONG else 1
    # No shrinking: a run depends on timing, so a smaller replay need not fail the same way. The
    # default run draws the same sequences every time (what varies is the timing); the long run
    # draws new ones.
    return settings(max_examples=examples * scale, stateful_step_count=steps, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate], derandomize=not LONG)


class Interrupted(Exception):
    """Raised by the SIGUSR1 handler in the main thread, as the engine's stop request is."""


def interrupted(e: BaseException | None) -> bool:
    """Whether ``e`` is ``Interrupted`` or was raised while handling or because of one (DALI
    builds its pipeline under a handler that turns any error into its own)."""
    while e is not None:
        if isinstance(e, Interrupted):
            return True
        e = e.__cause__ or e.__context__
    return False


class Interrupter:
    """Raise ``Interrupted`` in the main thread after ``delay`` s (from a timer thread, by
    SIGUSR1), if still armed: while ``next()`` waits on its workers, or wherever it is. The
    handler calls ``waiting_for()`` first, as the engine's stall timeout does."""

    def __init__(self, loader, delay: float):
        self.loader, self.delay, self.armed, self.description = loader, delay, False, None

    def handler(self, signum, frame):
        if self.armed:
            self.armed = False
            describe = getattr(self.loader, "waiting_for", None)
            self.description = describe() if describe else ""
            raise Interrupted()

    def __enter__(self):
        self.previous = signal.signal(signal.SIGUSR1, self.handler)
        self.timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGUSR1))
        self.timer.start()
        self.armed = True  # (a signal before this, while the timer started, does nothing)
        return self

    def __exit__(self, *exc):
        self.armed = False
        self.timer.cancel()
        self.timer.join()
        signal.signal(signal.SIGUSR1, self.previous)
        if self.description is not None:
            assert "\n" not in self.description


class LoaderMachine(RuleBasedStateMachine):
    """What every loader supports: passes, fetches, batches kept and let go, interrupts. A
    subclass makes the loader (``make``) and says which keys each batch holds."""

    def __init__(self):
        super().__init__()
        self.loader = None
        self.it = None  # the current pass's iterator
        self.expected: list[list] = []  # the key batches the current pass has still to serve
        self.ended: list = []  # iterators of ended passes: each must stop
        self.held: list[tuple] = []  # (x, y, x copy, y copy) of kept batches

    # what a subclass says
    def keys_of(self, x, y) -> list:
        raise NotImplementedError

    def order(self, data) -> list:
        """The sampler's keys for the next pass (drawn with ``data``), set on the sampler."""
        raise NotImplementedError

    def step(self, what: str):
        return deadline(STEP_SECONDS, f"{type(self).__name__}: {what}",
                        getattr(self.loader, "waiting_for", None))

    def end_pass(self):
        if self.it is not None:
            self.ended.append(self.it)
        self.it, self.expected = None, []

    def check(self, x, y):
        want = self.expected.pop(0)
        assert self.keys_of(x, y) == want

    # rules
    @rule(data=st.data())
    def start_pass(self, data):
        keys = self.order(data)
        self.end_pass()
        with self.step("iter()"):
            self.it = iter(self.loader)
        b = self.batch_size
        self.expected = [keys[i:i + b] for i in range(0, len(keys), b)]

    @rule(keep=st.booleans())
    def fetch(self, keep):
        if self.it is None:
            return
        with self.step("next()"):
            try:
                x, y = next(self.it)
            except StopIteration:
                assert not self.expected, f"the pass stopped with {len(self.expected)} to go"
                self.end_pass()
                return
        assert self.expected, "a batch past the end of the pass"
        self.check(x, y)
        if keep:
            self.held.append((x, y, x.clone(), y.clone()))

    @rule(which=ANY)
    def let_go(self, which):
        if self.held:
            self.held.pop(which % len(self.held))

    @rule(delay=st.floats(0, 0.02))
    def interrupt_a_fetch(self, delay):
        """A signal handler raises while ``next()`` runs. Raised while the fetch waited for a
        batch (``waiting_for()`` in the handler says which), it ends the pass: the iterator
        stops; raised later (the batch taken), the batch is lost: the iterator is let go
        unchecked. A new pass works either way."""
        if self.it is None:
            return
        self.slow(0.01)
        try:
            with self.step("next() interrupted"), Interrupter(self.loader, delay) as alarm:
                x, y = next(self.it)
        except StopIteration:
            self.end_pass()
            return
        except Exception as e:  # noqa: BLE001 - a library may turn it into another error
            if not interrupted(e):
                raise
            if " waits for batch " not in alarm.description:
                self.it = None
            self.end_pass()
            return
        finally:
            self.slow(0)
        self.check(x, y)

    @rule(ms=st.integers(1, 10))
    def consumer_works(self, ms):
        """The consumer takes its time (a training step): the loader's workers run ahead, and
        the next fetch finds the answers of several batches at once."""
        time.sleep(ms / 1000)

    def slow(self, seconds: float):
        """Reads take up to ``seconds`` (jittered) from now on, where the loader allows."""

    @invariant()
    def held_batches_do_not_change(self):
        for x, y, x0, y0 in self.held:
            assert torch.equal(x, x0) and torch.equal(y, y0), "a kept batch was overwritten"


# ----------------------------------------------------------------------------- the batch pool


class PoolMachine(LoaderMachine):
    """``BatchLoader`` with every rule: worker errors and deaths, close()."""

    @initialize(workers=st.sampled_from([8, 2, 1, 0]), n=st.integers(9, 40),
                batch=st.integers(1, 6), prefetch=st.integers(1, 2))
    def make(self, workers, n, batch, prefetch):
        # Read by the workers too (inherited shared memory): [most seconds a read takes, failing key]
        self.control = mmap.mmap(-1, 16)
        self.knobs = np.frombuffer(self.control, np.float64)
        self.knobs[:] = (0.0, -1)
        knobs = self.knobs
        dataset = KeyedDataset(n, delay=lambda keys: random.random() * knobs[0])
        dataset.read_batch = self.failing(dataset.read_batch, knobs)
        self.sampler = list(range(n))
        self.batch_size, self.workers = batch, workers
        self.shm_before = shm_names()
        self.mapped_before = collections.Counter(in_shm())  # (earlier tests' in this process)
        self.loader = BatchLoader(dataset, self.sampler, batch, workers=workers,
                                  prefetch_depth=prefetch)
        self.pids: set[int] = set()  # every worker ever started
        self.killed = False  # a worker was killed and its loss not reported yet
        self.failing_key = -1  # the key whose read fails in this pass (-1: none)

    @staticmethod
    def failing(read_batch, knobs):
        def read(keys, x, y):
            if knobs[1] in keys:
                raise ValueError(f"cannot read sample {int(knobs[1])}")
            read_batch(keys, x, y)
        return read

    def keys_of(self, x, y):
        return KeyedDataset.keys_of(x, y)

    def batches(self) -> list[list[int]]:
        keys, b = list(self.sampler), self.batch_size
        return [keys[i:i + b] for i in range(0, len(keys), b)]

    def order(self, data):
        self.sampler[:] = data.draw(st.permutations(range(len(self.sampler))))
        slow = data.draw(st.sampled_from([0, 0.001, 0.002, 0.005]))
        self.slow(slow)
        self.knobs[1] = self.failing_key = -1
        return list(self.sampler)

    def slow(self, seconds):
        self.knobs[0] = seconds

    def teardown(self):
        if self.loader is not None:
            with self.step("close() at the end"):
                self.loader.close()
            self.check_closed()

    def note_workers(self):
        if self.loader.workers:
            self.pids.update(w.process.pid for w in self.loader.workers)

    def end_pass(self):
        super().end_pass()
        self.note_workers()

    def check_closed(self):
        assert self.loader.workers is None
        left = wait_gone(self.pids, 1.0)
        assert not left, f"workers {left} outlived close()"
        new = shm_names() - self.shm_before
        assert not new, f"left in /dev/shm: {sorted(new)}"
        mapped = collections.Counter(in_shm()) - self.mapped_before
        assert not mapped, f"still mapped or open: {sorted(mapped.elements())}"

    def died(self):
        """A worker's loss reported (LoaderWorkerDied): the loader closed itself."""
        assert self.killed, "LoaderWorkerDied but no worker was killed"
        self.killed = False
        self.end_pass()
        self.check_closed()

    @contextlib.contextmanager
    def reported(self, failing: bool = False):
        """Around a rule: the loss of a killed worker, or (``failing``) the error of a read
        that fails, ends the pass."""
        self.note_workers()
        try:
            yield
        except LoaderWorkerDied:
            self.died()
        except (ValueError, RuntimeError) as e:
            assert failing and f"cannot read sample {self.failing_key}" in str(e), e
            self.end_pass()
        self.note_workers()

    @rule(data=st.data())
    def start_pass(self, data):
        with self.reported():
            super().start_pass(data)

    @rule(keep=st.booleans())
    def fetch(self, keep):
        failing = bool(self.expected) and self.failing_key in self.expected[0]
        with self.reported(failing):
            super().fetch(keep)
            assert not failing, "a batch with a failing read was served"

    @rule(delay=st.floats(0, 0.02))
    def interrupt_a_fetch(self, delay):
        with self.reported(failing=True):
            super().interrupt_a_fetch(delay)

    @rule(data=st.data(), delay=st.floats(0, 0.02))
    def interrupt_a_new_pass(self, data, delay):
        """A signal handler raises while ``iter()`` ends the last pass and starts one."""
        self.slow(0.01)
        self.sampler[:] = data.draw(st.permutations(range(len(self.sampler))))
        old, self.it, self.expected = self.it, None, []
        with self.reported():
            try:
                with self.step("iter() interrupted"), Interrupter(self.loader, delay):
                    self.it = iter(self.loader)
            except Interrupted:  # the last pass may have ended or not: let go unchecked
                return
            finally:
                self.slow(0)
            self.ended += [old] if old is not None else []
            self.expected = self.batches()

    @rule(ms=st.integers(0, 5))
    def first_batch_then_a_new_pass(self, ms):
        """The throughput report's way: a new pass for its first batch only (its other batches
        read meanwhile), then another pass."""
        with self.reported():
            self.end_pass()
            self.knobs[1] = self.failing_key = -1
            with self.step("iter() for one batch"):
                self.it, self.expected = iter(self.loader), self.batches()
            time.sleep(ms / 1000)
            LoaderMachine.fetch(self, keep=False)
            self.end_pass()
            with self.step("iter() after one batch"):
                self.it, self.expected = iter(self.loader), self.batches()

    @rule(which=ANY, row=ANY)
    def a_read_fails(self, which, row):
        """A key of a batch still to come fails to read (in a worker, or here): that batch
        raises the reader's error and ends the pass; the batches before it are served."""
        if self.it is None or self.killed or not self.expected:
            return
        batch = self.expected[which % len(self.expected)]
        key = batch[row % len(batch)]
        # Set before the pass: reads already done are not redone, so start a new pass with it.
        self.end_pass()
        self.knobs[1] = self.failing_key = key
        with self.reported(), self.step("iter() with a failing key"):
            self.it = iter(self.loader)
            self.expected = self.batches()

    @rule(which=ANY)
    def kill_a_worker(self, which):
        if not self.loader.workers or which % 3:  # a third as often, as close()
            return
        w = self.loader.workers[which % len(self.loader.workers)]
        self.note_workers()
        with contextlib.suppress(ProcessLookupError):  # ended by a close() interrupted
            os.kill(w.process.pid, signal.SIGKILL)
            self.killed = True

    @rule(which=ANY)
    def close(self, which):
        if which % 3:  # a third as often as the other rules: each close() costs new workers
            return
        self.note_workers()
        self.end_pass()
        with self.step("close()"):
            self.loader.close()
        self.killed = False
        self.check_closed()

    @invariant()
    def workers_live_until_closed(self):
        if self.loader is None or self.killed or self.loader.in_doubt:
            return  # in doubt: an interrupted close() may have ended some; the next op ends all
        for w in self.loader.workers or ():
            assert alive(w.process.pid), f"worker {w.index} died on its own"
        line = self.loader.waiting_for()
        assert line.startswith("batch loader: ") and "\n" not in line

    @invariant()
    def ended_passes_stop(self):
        for it in self.ended[-3:]:
            with self.step("next() of an ended pass"):
                with pytest.raises(StopIteration):
                    next(it)


PoolMachine.TestCase.settings = run_settings(examples=50, steps=60)
test_batch_pool_stress = PoolMachine.TestCase


# ----------------------------------------------------------------------------- other loaders


class ReferenceMachine(LoaderMachine):
    """A loader built by ``build`` from a U-Net config, its batches compared with the reads of
    the ``lowmem`` dataset (the reference every other loader equals)."""

    build = None
    mode = None

    @initialize()
    def make(self):
        from conftest import ROOT, write_cosmo_pair
        from datapipe.data_loader import build_loaders
        from settings.parse import build_config
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="stress-")
        root = write_cosmo_pair(os.path.join(self.tmp, "cosmo"))

        def loaders(mode):
            cfg = build_config(os.path.join(ROOT, "config", "UNet.yaml"), "quickstart",
                               {"data_root": root, "Nsamples": "10", "Nsamples_val": "6",
                                "data_loader_config": mode, "num_data_workers": "1"})
            cfg.data_size = 8  # crops of the 16^3 fixture box
            return build_loaders(cfg, 1, 0, 4, CPU)

        self.loaders, self.reference = loaders(self.mode), loaders("lowmem")
        self.loader, self.batch_size = self.loaders.train, 4
        self.epoch = 0

    def order(self, data):
        self.epoch = data.draw(st.integers(0, 3))
        self.loaders.train_sampler.set_epoch(self.epoch)
        self.reference.train_sampler.set_epoch(self.epoch)
        return list(self.reference.train_sampler)

    def check(self, x, y):
        want = self.expected.pop(0)
        ds = self.reference.train.dataset
        ds = getattr(ds, "dataset", ds)
        sx, sy = ds.sample_shapes
        ex, ey = np.empty((len(want), *sx), np.float32), np.empty((len(want), *sy), np.float32)
        ds.read_batch(want, ex, ey)
        assert torch.equal(x, torch.from_numpy(ex)) and torch.equal(y, torch.from_numpy(ey))

    def teardown(self):
        if self.loader is not None:
            for ld in (self.loaders, self.reference):
                ld.close()
            shutil.rmtree(self.tmp)


class DeviceMachine(ReferenceMachine):
    mode = "device"


class DALIMachine(ReferenceMachine):
    """Interrupts only fetches of a pass under way: one that comes while DALI builds its
    pipeline (a code transformation that catches every error) can leave DALI's own caches
    broken for every later build in the process."""

    mode = "dali-lowmem"

    @rule(delay=st.floats(0, 0.02))
    def interrupt_a_fetch(self, delay):
        if self.loader.pipe is not None and self.loader.open:
            super().interrupt_a_fetch(delay)


DeviceMachine.TestCase.settings = run_settings(examples=20, steps=40)
DALIMachine.TestCase.settings = run_settings(examples=10, steps=30)
test_device_loader_stress = DeviceMachine.TestCase


@pytest.fixture
def needs_dali():
    pytest.importorskip("nvidia.dali")


@pytest.mark.usefixtures("needs_dali")
class TestDALILoaderStress(DALIMachine.TestCase):
    pass
