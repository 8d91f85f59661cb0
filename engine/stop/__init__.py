"""Stopping a run, as the training loop meets it: one ``Stopper`` through which every batch is
fetched and the ranks agree to stop after the same step.

    for batch in stopper.batches(loader, "training", epoch, step, stop=save_and_stop): ...
    for size, batch in stopper.validation_batches(loader, epoch, sizes, n_valid): ...
    signum = stopper.stop_agreed()  # after the validation: the ranks stop together, or go on
    stopper.close()

What a user sees, how the ranks agree, why each batch is fetched ahead of its step and the lag:
docs/preemption.md, docs/parallelism.md (the stop agreement at scale) and docs/errors.md (a rank
waiting for data). The signals' record, the resume line and the run's ends: ``signals``.

**The data wait** (``fetch``): a stop signal (also one recorded before the fetch) whose batch has
not come ``SIGNAL_GRACE_S`` seconds later raises ``Interrupted`` inside the wait, and
``loader_timeout_s`` without the batch raises ``LoaderStalled``. Both are raised by Python signal
handlers (the stop signal's re-arms a one-shot ``ITIMER_REAL`` timer to the grace; the timer's
``SIGALRM`` handler raises): Python runs a handler in the main thread during any blocking wait of
its own (pipe reads, ``select``, locks, sleeps: PEP 475 retries them only after the handlers
ran), and a handler that raises unwinds the wait. A wait inside C code that never returns to
Python (DALI's executor) defers the handlers: a watchdog thread ends the process with the same
line ``watchdog_grace_s`` after the timeout. Outside the main thread no handler can be set.

**The agreement** (docs/preemption.md, "How the ranks agree"): after each fetch (a loader that
``never_waits``: each ``every``-th) every rank proposes, in one all-reduce (MAX) launched with
``async_op`` and read just before the batch's step. A rank fetches nothing more from a pass whose
wait was ended: its later proposals are those of a pass's end, at the same indices.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import math
import os
import signal
import statistics
import threading
import time

import torch
import torch.distributed as dist

from engine.stop.signals import LoaderStalled, NeverStop, RunEnding, RunStopped, StopRequest
from observe.profiling import nvtx_range
from settings.errors import TrainingError, print_error

__all__ = ["Stopper", "RunEnding", "StopRequest", "NeverStop", "RunStopped", "Interrupted"]

SIGNAL_GRACE_S = 2.0  # how long a fetch may still take once a stop signal came
WATCHDOG_GRACE_S = 30.0  # after the timeout, for a wait that no signal handler can end
MAX_LAG = 2  # steps a batch is fetched ahead, at most: gloo's 2 threads a group (docs/parallelism.md)
HIDDEN_S = 1e-3  # a decision's wait this short (or 5% of a step) counts as hidden

log = logging.getLogger(__name__)


class Interrupted(BaseException):
    """A stop signal ended a wait for data. A BaseException, as KeyboardInterrupt: no loader's
    or data set's ``except Exception`` may keep it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _TimedOut(BaseException):
    """Raised by the timer inside the wait; ``fetch`` turns it into ``LoaderStalled``."""


class Stopper:
    """``request``: the stop signals' record; ``distributed``: whether there are peers to agree
    with (``group``: the gloo group, None for the default one; ``every``: the log interval);
    ``timeout_s``: ``loader_timeout_s`` (0: none); ``advice()``: what the stall line ends with;
    ``fail(message)``: ends the process from the watchdog thread."""

    def __init__(self, request: StopRequest, distributed: bool, group=None, every: int = 1,
                 timeout_s: float = 0, advice=lambda: "", fail=None,
                 watchdog_grace_s: float = WATCHDOG_GRACE_S):
        self.request, self.group, self.every = request, group, max(1, every)
        self.distributed = distributed and getattr(request, "agrees", True)
        self.lag = 1  # steps ahead of its step that a batch is fetched (the same on every rank)
        # the proposals in flight, oldest first: (index, (work, tensor, launch time) or value)
        self._pending = collections.deque()
        self._needed = []  # per decision since the last ``now``: the lag that hides its wait
        self._last = None  # (index, time its wait ended) of the pass's last decision
        self.proposals = 0  # all-reduces launched (read by the collective census)
        self._interrupted = 0  # the signal that ended the validation's wait for a batch, or 0
        self.timeout_s, self.advice, self.fail = timeout_s, advice, fail or _print_and_exit
        self.watchdog_grace_s = watchdog_grace_s
        self._waiting = None  # (what it waits for as a callable, its timeout deadline) or None
        self._signal_deadline = math.inf
        self._watchdog = None
        self._closed = threading.Event()  # the run is over: the watchdog thread ends
        self._unwinding = False  # a handler raised out of the wait, which unwinds now

    # ---------------------------------------------------------------- the passes

    def batches(self, loader, what: str, epoch: int, step: int, first: int = 0,
                end: int | None = None, stop=None, around=contextlib.nullcontext, begun=None,
                first_recorded: bool = False):
        """The batches of a pass of ``loader`` for the steps ``step``, ``step + 1``, ... (up to
        ``end``: nothing fetched from there on), each fetched ``lag`` steps ahead in a data wait
        inside ``around()`` (``what``, ``epoch``, ``first``: what the stall line names;
        ``begun``: the pass, already begun). Where every rank agreed to stop before a step,
        ``stop(signum)`` is called there (it writes the checkpoint and raises ``RunStopped``).
        The first proposal holds no recorded signal unless ``first_recorded``."""
        fetches = self._pass(loader, what, epoch, first, around, begun)
        self.drain()  # a pass left before its end (the throughput report's rounds) leaves some
        fetched = collections.deque()
        done = False  # the pass ended, or a signal ended a wait: no more fetches from it
        self._last = None

        def fetch(index: int, recorded: bool = True):
            nonlocal done
            done = done or end is not None and index >= end
            batch, interrupted = (None, 0) if done else next_batch(fetches)
            done = batch is None
            self.after_fetch(loader, index, interrupted, recorded)
            fetched.append(batch)

        fetch(step, recorded=first_recorded)
        for index in itertools.count(step):
            signum = self.decision(index)
            batch = fetched.popleft()
            if signum or batch is None:
                self.drain()
                if signum:
                    stop(signum)
                return
            while len(fetched) < self.lag:
                fetch(index + 1 + len(fetched))
            yield batch

    def validation_batches(self, loader, epoch: int, sizes: list[int], n_valid: int):
        """``(size, batch)`` for each of the validation's forwards, ``sizes`` its batch sizes on
        this rank: ``batch`` None where it has none (size 0), or where a stop signal ended its
        wait (docs/preemption.md: the forwards go on, on a stand-in). No batch at all (``n_valid``
        samples), or more batches than ``sizes``, is a TrainingError. After a first wait that a
        signal ended on any rank, every rank leaves before any forward."""
        if not sizes:
            raise TrainingError("the validation set is empty: check the validation data")
        fetches = self._pass(loader, "validation", epoch)
        self._interrupted = 0
        for i, size in enumerate(sizes):
            batch = None
            if size and not self._interrupted:
                batch, self._interrupted = next_batch(fetches)
            if i == 0 and may_wait(loader):
                # Collective (host, once per validation): the first wait, ended on any rank.
                self._interrupted = self.now(self._interrupted, recorded=False)
                if self._interrupted:
                    return
            yield size, batch
        if not self._interrupted:  # the pass's end: its shard's batches are all taken
            extra, self._interrupted = next_batch(fetches)
            if extra is not None:
                raise TrainingError(f"the validation loader {type(loader).__name__} gave more "
                                    f"batches than its shard of {n_valid} samples holds "
                                    f"({sum(map(bool, sizes))})")

    def stop_agreed(self) -> int:
        """After a validation: the signal every rank stops on now (0: go on), when a stop signal
        ended a wait for its data on any rank. Collective (host, blocking: once per
        validation). A signal recorded then but ending no wait is left to training (the epoch's
        validation is logged and written first)."""
        interrupted, self._interrupted = self._interrupted, 0
        return self.now(interrupted, recorded=False)

    def signalled(self) -> int:
        """At the run's end: the signal any rank recorded (0: none). Collective (host,
        blocking)."""
        self._needed = []  # (no step follows: no lag to choose)
        return self.now()

    def _pass(self, loader, what: str, epoch: int, first: int = 0,
              around=contextlib.nullcontext, begun=None):
        """The items of a pass of ``loader``, each fetched (the pass's start too) in a data
        wait, or with plain calls from a loader that never waits."""
        it = begun
        fetch = self.fetch if may_wait(loader) else lambda *_: contextlib.nullcontext()
        for i in itertools.count(first):
            with nvtx_range("data wait"), around(), fetch(loader, what, epoch, i):
                try:
                    it = iter(loader) if it is None else it  # a new pass may wait for the last
                    item = next(it)
                except StopIteration:
                    return
            yield item

    # ---------------------------------------------------------------- the ranks' agreement

    def after_fetch(self, loader, index: int, interrupted: int = 0, recorded: bool = True):
        """Propose after the fetch of batch ``index`` (the step it is for) when the cadence
        says so; a recorded signal only at a log point, and only if ``recorded``."""
        log_point = index % self.every == 0
        if may_wait(loader) or log_point:
            self.propose(interrupted, recorded=recorded and log_point, index=index)

    def propose(self, interrupted: int = 0, recorded: bool = True, index: int | None = None,
                lag: int = 0):
        """Launch this rank's proposal for step ``index`` (``interrupted``, else the recorded
        signal if ``recorded``) with the ``lag`` it asks for (0: none). Collective when
        distributed, without waiting."""
        proposal = interrupted or (self.request.signum if recorded else 0)
        if not self.distributed:
            self._pending.append((index, proposal))
            return
        t = torch.tensor([proposal, lag], dtype=torch.int32)
        # Collective (host, gloo, async): read by ``decision`` before the step.
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending.append((index, (work, t, time.perf_counter())))
        self.proposals += 1

    def decision(self, index: int | None = None, note: bool = True) -> int:
        """The signal every rank stops on before step ``index`` (0: go on; ``index`` None: the
        oldest proposal in flight), 0 when no proposal was launched for it. Waits for its
        all-reduce and (``note``) notes the lag that would have hidden the wait: 0 where it was
        hidden (at most ``HIDDEN_S`` or 5% of a step, the time between decisions per step)."""
        if not self._pending or index is not None and self._pending[0][0] != index:
            return 0
        _, pending = self._pending.popleft()
        if not isinstance(pending, tuple):
            return pending or 0
        work, t, launched = pending
        read = time.perf_counter()
        work.wait()
        done = time.perf_counter()
        waited = done - read
        if note and index is not None and self._last is not None and index > self._last[0]:
            step = (read - self._last[1]) / (index - self._last[0])  # without the waits
            hidden = waited <= max(HIDDEN_S, 0.05 * step)
            self._needed.append(0 if hidden else math.ceil((done - launched) / step))
        self._last = (index, done) if note and index is not None else None
        signum, lag = (int(v) for v in t.tolist())  # a CPU tensor: no device sync
        if min(lag, MAX_LAG) > self.lag:
            self.lag = min(lag, MAX_LAG)
            log.info(f"Stop agreement: its all-reduce over the ranks outlasted a step; each batch "
                     f"is now fetched {self.lag} steps ahead of its step, so that {self.lag} "
                     f"agreements run at once")
        return signum

    def drain(self):
        """Wait for every proposal still in flight (those of fetches past a stop or a pass's
        end: the same on every rank) and drop them."""
        while self._pending:
            _, pending = self._pending.popleft()
            if isinstance(pending, tuple):
                pending[0].wait()

    def now(self, interrupted: int = 0, recorded: bool = True) -> int:
        """A blocking agreement (twice per validation at most), carrying the lag this rank asks
        for: the median of what its decisions since the last one needed; all take the largest."""
        self.drain()
        lag = statistics.median_low(self._needed) if self._needed else 0
        self._needed = []
        self.propose(interrupted, recorded, lag=lag)
        return self.decision(note=False)  # (its wait is not a step's)

    # ---------------------------------------------------------------- the data wait

    @contextlib.contextmanager
    def fetch(self, loader, what: str, epoch: int, batch: int):
        """A wait for ``loader``'s next batch (``batch`` of ``epoch``, 0-based), which raises
        ``Interrupted`` (a stop signal) or ``LoaderStalled`` (the timeout)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        now = time.monotonic()
        deadline = now + self.timeout_s if self.timeout_s else math.inf
        waited = functools.partial(describe_wait, loader, what, epoch, batch)
        previous = signal.signal(signal.SIGALRM, self._alarm)
        self._waiting = (waited, deadline)
        self._signal_deadline = now + SIGNAL_GRACE_S if self.request.signum else math.inf
        self.request.while_waiting = self.signal_came
        self._arm()
        if self.timeout_s:
            self._start_watchdog()
        try:
            yield
        except _TimedOut:
            raise LoaderStalled(stall_message(waited(), self.timeout_s, self.advice())) from None
        finally:
            self._waiting, self._unwinding = None, False
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.request.while_waiting = None
            signal.signal(signal.SIGALRM, previous)

    def signal_came(self):
        """Called by the stop-signal handler during a wait: the batch has the grace to come."""
        if self._waiting is not None and self._signal_deadline == math.inf \
                and not self._unwinding:
            self._signal_deadline = time.monotonic() + SIGNAL_GRACE_S
            self._arm()

    def _arm(self):
        """The timer, to the nearer of the timeout and the signal's grace (a wait is on)."""
        due = min(self._waiting[1], self._signal_deadline)
        if due < math.inf:
            signal.setitimer(signal.ITIMER_REAL, max(due - time.monotonic(), 1e-3))

    def _alarm(self, signum, frame):
        if self._waiting is None or self._unwinding:  # came as the wait ended, or unwinds
            return
        now = time.monotonic()
        interrupted = self.request.signum if now >= self._signal_deadline - 1e-3 else 0
        if not interrupted and now < self._waiting[1] - 1e-3:
            return self._arm()  # early: again for what is left
        # The wait ends: no handler raises again, and the watchdog stays armed while the
        # loader's code unwinds (its clean-up, DALI's pipeline dropped, may itself block):
        # ``watchdog_grace_s`` from now it ends the process.
        self._unwinding = True
        self._waiting = (self._waiting[0], now)
        self._start_watchdog()
        raise Interrupted(interrupted) if interrupted else _TimedOut()

    def close(self):
        """The run is over: the watchdog thread ends (while it runs it holds what ``advice`` and
        ``fail`` refer to: the trainer, its model and its process groups)."""
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)

    def _start_watchdog(self):
        if self._watchdog is None and not self._closed.is_set():
            self._watchdog = threading.Thread(target=self._watch, name="data-wait-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _watch(self):
        """Every second: a wait past its timeout by ``watchdog_grace_s`` is one whose handlers
        cannot run, or (``_unwinding``) one whose clean-up blocks: end the process with its
        line."""
        while not self._closed.wait(min(1.0, self.watchdog_grace_s)):
            waiting = self._waiting
            if waiting is not None and time.monotonic() > waiting[1] + self.watchdog_grace_s:
                if self._unwinding:
                    self.fail(f"{waiting[0]()} did not let go within {self.watchdog_grace_s:g} s "
                              f"of its wait's end (a stop signal or loader_timeout_s): its "
                              f"clean-up blocks, likely in a read of a stalled file system. "
                              f"{self.advice()}")
                else:
                    self.fail(stall_message(waiting[0](), self.timeout_s, self.advice()))
                return


def describe_wait(loader, what: str, epoch: int, batch: int) -> str:
    """What the ``what`` loader is waiting for: its own ``waiting_for()`` (the batch pool's: the
    pass, the batch, its workers alive or dead, the parts outstanding) where it has one and it
    answers, else its class, its workers, the epoch and the batch."""
    name = type(loader).__name__
    waiting_for = getattr(loader, "waiting_for", None)
    if callable(waiting_for):
        try:
            return f"the {what} loader ({name}: {waiting_for()})"
        except Exception:  # noqa: BLE001 - a description must not hide the stall it describes
            pass
    workers = getattr(loader, "num_workers", None)
    with_workers = f", {workers} worker process{'es' if workers > 1 else ''}" if workers else ""
    return f"the {what} loader ({name}{with_workers}: epoch {epoch + 1}, batch {batch + 1})"


def stall_message(waited: str, timeout_s: float, advice: str) -> str:
    return (f"no batch came for {timeout_s:g} s (loader_timeout_s): {waited}. The data's file "
            f"system stopped answering or a read hangs: check the file system, see where a "
            f"read waits with py-spy dump --pid <a worker's pid; this process is "
            f"{os.getpid()}>, or raise --loader_timeout_s if reads are legitimately this slow. "
            f"{advice}")


def may_wait(loader) -> bool:
    """Whether a rank can be held in a fetch from ``loader`` (one that a signal may end): every
    loader but one that makes its batches in this process from memory (``never_waits``)."""
    return not getattr(loader, "never_waits", False)


def next_batch(batches) -> tuple[object, int]:
    """(the next item of ``batches``, or None at the pass's end; the stop signal that ended the
    wait for it, or 0)."""
    try:
        return next(batches), 0
    except StopIteration:
        return None, 0
    except Interrupted as e:
        return None, e.signum


def _print_and_exit(message: str):
    print_error(message)
    os._exit(1)
