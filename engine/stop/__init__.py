"""Stopping a run: the stop signals (``signals``), the waits for data that a signal or
``loader_timeout_s`` ends (``waits``), the ranks' agreement on the step to stop after
(``agreement``) and every way a run ends (``signals.RunEnding``, around the entry point),
behind one object the loop talks to, ``Stopper``:

    for batch in stopper.batches(loader, "training", epoch, step, stop=save_and_stop): ...
    for size, batch in stopper.validation_batches(loader, epoch, sizes, n_valid): ...
    signum = stopper.stop_agreed()  # after the validation: the ranks stop together, or go on
    stopper.close()

What a user sees of it: docs/preemption.md and docs/errors.md (a rank waiting for data).
"""
from __future__ import annotations

import contextlib

from engine.stop.agreement import StopAgreement
from engine.stop.signals import NeverStop, RunEnding, RunStopped, StopRequest
from engine.stop.waits import DataWaits, may_wait, next_batch
from settings.errors import TrainingError

__all__ = ["Stopper", "RunEnding", "StopRequest", "NeverStop", "RunStopped"]


class Stopper:
    """A run's stopping: ``request``, the stop signals' record (``StopRequest.install``, or
    ``NeverStop``); the ranks' agreement (``distributed``, ``group``, ``every``: the log
    interval; ``StopAgreement``) and the data waits (``timeout_s``: ``loader_timeout_s``,
    ``advice``, ``fail``: ``DataWaits``'s ``hard_exit``)."""

    def __init__(self, request: StopRequest, distributed: bool, group=None, every: int = 1,
                 timeout_s: float = 0, advice=lambda: "", fail=None):
        self.request = request
        self.waits = DataWaits(request, timeout_s, advice, fail)
        self.agreement = StopAgreement(request, distributed, group, every)
        self._interrupted = 0  # the signal that ended the validation's wait for a batch, or 0

    @property
    def signum(self) -> int:
        """The signal this rank has recorded (0: none)."""
        return self.request.signum

    @property
    def lag(self) -> int:
        """Steps ahead of its step that each batch is fetched (the same on every rank)."""
        return self.agreement.lag

    def batches(self, loader, what: str, epoch: int, step: int, first: int = 0,
                end: int | None = None, stop=None, around=contextlib.nullcontext, begun=None,
                first_recorded: bool = False):
        """The batches of a pass of ``loader`` for the steps ``step``, ``step + 1``, ... (up to
        ``end``), each fetched in a data wait (``DataWaits.batches``: ``what``, ``epoch``,
        ``first``, ``around``, ``begun``) ahead of its step (``StopAgreement.batches``). When
        every rank agreed to stop before a step, ``stop(signum)`` is called there (it writes the
        checkpoint and raises ``RunStopped``) and the pass ends. A signal recorded before the
        pass stops it at once only if ``first_recorded``."""
        fetches = self.waits.batches(loader, what, epoch, first, around, begun)
        for signum, batch in self.agreement.batches(loader, fetches, step, end, first_recorded):
            if signum:
                stop(signum)
                return
            yield batch

    def validation_batches(self, loader, epoch: int, sizes: list[int], n_valid: int):
        """``(size, batch)`` for each of the validation's forwards, ``sizes`` its batch sizes on
        this rank (0: a forward with no batch of its own): ``batch`` None where it has none, or
        where a stop signal ended its wait for one (the forwards go on, on a stand-in, so that
        their collectives meet the peers'). A validation set with no batch (``n_valid``
        samples in all), or a loader that gives more batches than ``sizes``, is a TrainingError.
        With a loader that may wait, the ranks agree after the first fetch: a rank whose first
        wait a signal ended has no stand-in, so every rank then leaves before any forward, and
        ``stop_agreed`` stops them."""
        if not sizes:
            raise TrainingError("the validation set is empty: check the validation data")
        fetches = self.waits.batches(loader, "validation", epoch)
        self._interrupted = 0
        for i, size in enumerate(sizes):
            batch = None
            if size and not self._interrupted:
                batch, self._interrupted = next_batch(fetches)
            if i == 0 and may_wait(loader):
                # Collective (host, once per validation): the first wait, ended on any rank.
                self._interrupted = self.agreement.now(self._interrupted, recorded=False)
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
        return self.agreement.now(interrupted, recorded=False)

    def close(self):
        """The run is over: the data waits' watchdog thread ends (while it runs it holds what
        ``advice`` and ``fail`` refer to)."""
        self.waits.close()
