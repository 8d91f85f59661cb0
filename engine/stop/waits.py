"""Waiting for data with a way out: the stop signals and ``loader_timeout_s`` reach a rank blocked
on its loader (what a user sees: docs/errors.md, "A rank waiting for data").

The engine fetches every batch from a loader that may wait inside ``DataWaits.fetch``: a stop
signal (also one recorded before the fetch) whose batch has not come ``SIGNAL_GRACE_S`` seconds
later raises ``Interrupted`` inside the wait, and ``loader_timeout_s`` without the batch raises
``LoaderStalled``. Both are raised by Python signal handlers (the stop signal's re-arms a one-shot
``ITIMER_REAL`` timer to the grace; the timer's ``SIGALRM`` handler raises): Python runs a
handler in the main thread during any blocking wait of its own (pipe reads, ``select``, locks,
sleeps: PEP 475 retries them only after the handlers ran), and a handler that raises unwinds the
wait. A wait inside C code that never returns to Python (DALI's executor) defers the handlers: a
watchdog thread ends the process with the same line ``WATCHDOG_GRACE_S`` seconds after the
timeout. A loader that makes each batch in this process from memory (``never_waits``) is fetched
with plain calls. Outside the main thread no handler can be set: fetches there wait as the
loader does.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import signal
import threading
import time

from observe.profiling import nvtx_range
from settings.errors import TrainingError, print_error

SIGNAL_GRACE_S = 2.0  # how long a fetch may still take once a stop signal came
WATCHDOG_GRACE_S = 30.0  # after the timeout, for a wait that no signal handler can end


class Interrupted(BaseException):
    """A stop signal ended a wait for data. A BaseException, as KeyboardInterrupt: no loader's
    or data set's ``except Exception`` may keep it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _TimedOut(BaseException):
    """Raised by the timer inside the wait; ``fetch`` turns it into ``LoaderStalled``."""


class LoaderStalled(TrainingError):
    """A rank waited ``loader_timeout_s`` for its next batch."""


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


class DataWaits:
    """The fetches of one run: ``stop_request`` (its handlers call ``signal_came``) and
    ``timeout_s`` (0: none). ``advice()``: what the stall line ends with (the checkpoint kept);
    ``hard_exit(message)``: ends the process from the watchdog thread, ``watchdog_grace_s``
    after the timeout."""

    def __init__(self, stop_request, timeout_s: float, advice=lambda: "", hard_exit=None,
                 watchdog_grace_s: float = WATCHDOG_GRACE_S):
        self.stop_request, self.timeout_s, self.advice = stop_request, timeout_s, advice
        self.hard_exit = hard_exit or _print_and_exit
        self.watchdog_grace_s = watchdog_grace_s
        self._waiting = None  # (what it waits for as a callable, its timeout deadline) or None
        self._signal_deadline = math.inf
        self._watchdog = None
        self._closed = threading.Event()  # the run is over: the watchdog thread ends
        self._unwinding = False  # a handler raised out of the wait, which unwinds now

    def batches(self, loader, what: str, epoch: int, first: int = 0,
                around=contextlib.nullcontext, begun=None):
        """The batches of a pass of ``loader`` (the pass's start included) fetched in data waits
        (``fetch``), each inside ``nvtx_range("data wait")`` and ``around()`` (e.g. a context that
        times it); ``first``: the index of the pass's first batch (a resumed epoch's step);
        ``begun``: the pass, already begun (``Loaders.begin_training_pass``), or None."""
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

    @contextlib.contextmanager
    def fetch(self, loader, what: str, epoch: int, batch: int):
        """A wait for ``loader``'s next batch (``what``: "training", "validation", ...; the
        ``epoch`` and ``batch`` it is, 0-based). Raises ``Interrupted`` (a stop signal) or
        ``LoaderStalled`` (the timeout) out of the wait."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        now = time.monotonic()
        deadline = now + self.timeout_s if self.timeout_s else math.inf
        waited = functools.partial(describe_wait, loader, what, epoch, batch)
        previous = signal.signal(signal.SIGALRM, self._alarm)
        self._waiting = (waited, deadline)
        self._signal_deadline = now + SIGNAL_GRACE_S if self.stop_request.signum else math.inf
        self.stop_request.while_waiting = self.signal_came
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
            self.stop_request.while_waiting = None
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
        interrupted = self.stop_request.signum if now >= self._signal_deadline - 1e-3 else 0
        if not interrupted and now < self._waiting[1] - 1e-3:
            return self._arm()  # early: again for what is left
        # The wait ends: no handler raises again, and the watchdog stays armed while the
        # loader's code unwinds (its clean-up, DALI's pipeline dropped, may itself block):
        # ``watchdog_grace_s`` from now it ends the process.
        self._unwinding = True
        self._waiting = (self._waiting[0], now)
        self._start_watchdog()
        raise Interrupted(interrupted) if interrupted else _TimedOut()

    # ---------------------------------------------------------------- waits no handler ends

    def close(self):
        """End the watchdog thread (the run is over): while it runs it holds what ``advice`` and
        ``hard_exit`` refer to (the trainer, its model and its process groups)."""
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
                    self.hard_exit(f"{waiting[0]()} did not let go within "
                                   f"{self.watchdog_grace_s:g} s of its wait's end (a stop "
                                   f"signal or loader_timeout_s): its clean-up blocks, likely "
                                   f"in a read of a stalled file system. {self.advice()}")
                else:
                    self.hard_exit(stall_message(waiting[0](), self.timeout_s, self.advice()))
                return


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
