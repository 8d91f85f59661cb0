"""How the ranks agree to stop at the same step: the cadence, the group and the collective, here
and nowhere else.

A stop signal (``engine.preemption.StopRequest``) may reach one rank, several or all, at any
moment, and a rank held in a wait for data leaves it when a signal ends the wait
(``engine.data_waits``). Every rank must then stop after the same step, write the checkpoint of
that step and exit with ``STOPPED_EXIT_CODE``.

The training loop fetches each batch one step ahead: the batch of step k+1 is fetched before
step k runs. After each fetch every rank *proposes* (``propose``): the signal that ended its wait
for the batch, or any signal it has recorded, or 0. The proposals are combined by one all-reduce
(MAX) launched without waiting (``async_op``, on a gloo group: host memory, no device sync), and
the *decision* is read (``decision``) after step k, before step k+1, a whole step later, by when
the all-reduce has long finished. No rank waits on it in the steady state: it costs a launch per
step, not a ring of 2(N-1) messages on the critical path.

Why fetching ahead keeps the guarantee: a rank whose wait for batch k+1 a signal ended still
has batch k, so it runs step k with its peers (whose collectives in step k would otherwise wait
for it forever) and all read the same decision before step k+1: they stop after step k. A
decision read one step late without the fetch ahead would come too late: the peers would already
be waiting in step k+1's collectives for a rank that has no batch for it.

The cadence: after every fetch from a loader that may wait (it reads: a rank can be held in its
fetch); with one that never waits (``never_waits``: batches made in this process from memory) no
rank can be held, so the ranks propose only after every ``every``-th fetch (the log interval). A
signal that ended no wait is proposed at those log points only: the run stops at a log point,
the first after the signal whose batch was fetched after it (a resumed run then logs the same
loss points as an uninterrupted one). A trainer driven without the entry point (``NeverStop``)
never takes part in a collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.data_waits import may_wait


class StopAgreement:
    """The ranks' decisions to stop. ``stop_request``: this rank's recorded signal (``signum``);
    ``distributed``: whether there are peers to agree with (a ``NeverStop`` request never
    agrees); ``group``: the all-reduce's group (gloo; None: the default group, when it is
    gloo); ``every``: the cadence with a loader that never waits."""

    def __init__(self, stop_request, distributed: bool, group=None, every: int = 1):
        self.stop_request, self.group, self.every = stop_request, group, max(1, every)
        self.distributed = distributed and getattr(stop_request, "agrees", True)
        self._pending = None  # the proposal in flight: (work, tensor), a local signal, or None
        self.proposals = 0  # all-reduces launched (read by the collective census)

    def after_fetch(self, loader, index: int, interrupted: int = 0, recorded: bool = True):
        """Propose after the fetch of batch ``index`` from ``loader`` (``index`` counted the same
        way on every rank: the step it is for), when due: after each fetch from a loader that may
        wait (``interrupted``: the signal that ended the wait, or 0), else after every
        ``every``-th. A signal merely recorded is proposed at every ``every``-th fetch (the
        log points: stops land there), unless not ``recorded`` (a pass's first fetch: a run
        takes a step before a recorded signal stops it)."""
        log_point = index % self.every == 0
        if may_wait(loader) or log_point:
            self.propose(interrupted, recorded=recorded and log_point)

    def propose(self, interrupted: int = 0, recorded: bool = True):
        """Launch this rank's proposal: ``interrupted``, else the signal it has recorded (unless
        not ``recorded``). Collective when distributed, and without waiting: every rank
        proposes at the same points."""
        proposal = interrupted or (self.stop_request.signum if recorded else 0)
        if not self.distributed:
            self._pending = proposal
            return
        t = torch.tensor([proposal], dtype=torch.int32)
        # Collective (host, gloo, async): read by ``decision`` a step later.
        self._pending = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True), t)
        self.proposals += 1

    def decision(self) -> int:
        """The signal every rank stops on now (0: go on): the combined proposal launched last,
        once; 0 when none was launched since the last decision. Waits for the all-reduce, which
        in the steady state has finished while the step ran."""
        pending, self._pending = self._pending, None
        if not isinstance(pending, tuple):
            return pending or 0
        work, t = pending
        work.wait()
        return int(t.item())  # a CPU tensor: no device sync

    def now(self, interrupted: int = 0, recorded: bool = True) -> int:
        """Propose and wait for the decision at once: a blocking agreement, for twice per
        validation at most (a signal recorded then but ending no wait is left to training,
        ``recorded=False``: the epoch's validation is logged and written first)."""
        self.propose(interrupted, recorded)
        return self.decision()
