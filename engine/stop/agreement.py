"""How the ranks agree to stop at the same step: the cadence, the group and the collective, here
and nowhere else (what it costs a step: docs/preemption.md).

A stop signal may reach one rank, several or all, at any moment, and a signal may end a rank's
wait for data (``engine.stop.waits``); every rank must still stop after the same step. Each
step's batch is fetched ``lag`` steps ahead; after each fetch every rank *proposes* (the signal
that ended its wait, or one it recorded, or 0) in one all-reduce (MAX) on a gloo group, launched
with ``async_op`` (host memory, no device sync), and the *decision* is read just before the
batch's step, by when the all-reduce has finished: no rank waits on it in the steady state.

Why fetching ahead keeps the guarantee: a rank whose wait for the batch of step k a signal
ended still holds the batches before it, so it runs those steps with its peers (whose
collectives would otherwise wait for it forever) and all read the same decision before step k.
Read without the fetch ahead, the decision would come too late: the peers would already wait in
step k's collectives for a rank that has no batch for it. A rank fetches nothing more from a
pass whose wait was ended: its later proposals are those of a pass's end, at the same indices.

The lag: 1 to start with. Where the ring outlasts a step, each rank notes per decision the lag
that would have hidden it, and the blocking agreement after each validation (``now``) carries
the median since the last one: the ranks' largest becomes every rank's lag, at most
``MAX_LAG``, never lowered (chosen together between epochs, when no proposal is in flight).

The cadence: after every fetch from a loader that may wait; with one that never waits
(``never_waits``) no rank can be held, so only after every ``every``-th fetch (the log interval).
A signal that ended no wait is proposed at those log points only, so a resumed run logs the same
loss points as an uninterrupted one. ``NeverStop`` never takes part in a collective.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import statistics
import time

import torch
import torch.distributed as dist

from engine.stop.waits import may_wait, next_batch

# Steps a batch is fetched ahead of its step, at most (each one held in memory): gloo runs a
# group's collectives on 2 threads, each held for the whole of its ring, so 2 in flight at once
# is what a deeper lag could use.
MAX_LAG = 2
HIDDEN_S = 1e-3  # a decision's wait this short (or 5% of a step) counts as hidden

log = logging.getLogger(__name__)


class StopAgreement:
    """The ranks' decisions to stop. ``stop_request``: this rank's recorded signal (``signum``);
    ``distributed``: whether there are peers to agree with (a ``NeverStop`` request never
    agrees); ``group``: the all-reduce's group (gloo; None: the default group, when it is
    gloo); ``every``: the cadence with a loader that never waits."""

    def __init__(self, stop_request, distributed: bool, group=None, every: int = 1):
        self.stop_request, self.group, self.every = stop_request, group, max(1, every)
        self.distributed = distributed and getattr(stop_request, "agrees", True)
        self.lag = 1  # steps ahead of its step that a batch is fetched (the same on every rank)
        # the proposals in flight, oldest first: (index, (work, tensor, launch time) or value)
        self._pending = collections.deque()
        self._needed = []  # per decision since the last ``now``: the lag that hides its wait
        self._last = None  # (index, time its wait ended) of the pass's last decision
        self.proposals = 0  # all-reduces launched (read by the collective census)

    def batches(self, loader, batches, start: int, end: int | None = None,
                first_recorded: bool = False):
        """Yield ``(signum, batch)`` for the steps ``start``, ``start + 1``, ... from the pass
        ``batches`` of ``loader``: each batch fetched ``lag`` steps before its step, and each
        decided just before it. A non-zero ``signum`` (batch None, last): every rank stops
        before this step. Ends at the pass's end, at ``end`` (nothing fetched for a step from
        there on, its proposal still made) or after a wait a signal ended, with nothing left in
        flight. The pass's first proposal holds no recorded signal (an epoch takes a step)
        unless ``first_recorded``."""
        self.drain()  # a pass left before its end (the throughput report's rounds) leaves some
        fetched = collections.deque()
        done = False  # the pass ended, or a signal ended a wait: no more fetches from it
        self._last = None

        def fetch(index: int, recorded: bool = True):
            nonlocal done
            done = done or end is not None and index >= end
            batch, interrupted = (None, 0) if done else next_batch(batches)
            done = batch is None
            self.after_fetch(loader, index, interrupted, recorded)
            fetched.append(batch)

        fetch(start, recorded=first_recorded)
        for index in itertools.count(start):
            signum = self.decision(index)
            batch = fetched.popleft()
            if signum or batch is None:
                self.drain()
                if signum:
                    yield signum, None
                return
            while len(fetched) < self.lag:
                fetch(index + 1 + len(fetched))
            yield 0, batch

    def after_fetch(self, loader, index: int, interrupted: int = 0, recorded: bool = True):
        """Propose after the fetch of batch ``index`` (the step it is for, the same on every
        rank) from ``loader`` when due (the cadence above; ``interrupted``: the signal that
        ended the wait, or 0). A recorded signal is proposed at log points only, and not at all
        unless ``recorded`` (a pass's first fetch: a run takes a step before it stops)."""
        log_point = index % self.every == 0
        if may_wait(loader) or log_point:
            self.propose(interrupted, recorded=recorded and log_point, index=index)

    def propose(self, interrupted: int = 0, recorded: bool = True, index: int | None = None,
                lag: int = 0):
        """Launch this rank's proposal for step ``index``: ``interrupted``, else the signal it
        has recorded (unless not ``recorded``), with the ``lag`` it asks for (0: none).
        Collective when distributed, and without waiting: every rank proposes at the same
        points."""
        proposal = interrupted or (self.stop_request.signum if recorded else 0)
        if not self.distributed:
            self._pending.append((index, proposal))
            return
        t = torch.tensor([proposal, lag], dtype=torch.int32)
        # Collective (host, gloo, async): read by ``decision`` before the step.
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending.append((index, (work, t, time.perf_counter())))
        self.proposals += 1

    def decision(self, index: int | None = None, note: bool = True) -> int:
        """The signal every rank stops on before step ``index`` (0: go on): the combined
        proposal launched after that step's fetch, the oldest in flight (``index`` None: the
        oldest); 0 when none was launched for it. Waits for its all-reduce, which in the steady
        state finished while the steps before ran, and (``note``) notes the lag that would
        have hidden the wait: 0 where it was hidden (at most ``HIDDEN_S`` or 5% of a step: the
        time from one decision's end to the next one's read, over the steps between them)."""
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
        """Propose and wait for the decision at once: a blocking agreement, twice per validation
        at most. It carries the lag this rank asks for: the median of what its decisions since
        the last one needed; every rank takes the largest."""
        self.drain()
        lag = statistics.median_low(self._needed) if self._needed else 0
        self._needed = []
        self.propose(interrupted, recorded, lag=lag)
        return self.decision(note=False)  # (its wait is not a step's)
