"""The ranks' stop agreement (engine.stop's Stopper) on real gloo ranks: a proposal never waits
for the peers, the decision is the same on every rank, and the cadence is the same on every
rank whatever the loader; batches fetched ``lag`` steps ahead, the lag the ranks choose
together where the ring outlasts a step, and a stateful stress test of the rules over random
passes."""
import itertools
import time

import pytest

from distributed_harness import run_ranks


class _Request:
    agrees = True

    def __init__(self):
        self.signum = 0


class _Reads:  # a loader that may wait
    pass


class _Cached:  # one that never waits
    never_waits = True


class _Over:
    """A loader whose pass is ``items``; one that may wait unless ``never_waits``."""

    def __init__(self, items, never_waits: bool = False):
        self.items, self.never_waits = items, never_waits

    def __iter__(self):
        return iter(self.items)


def _decided(stopper, loader, **kw):
    """``(0, batch)`` for each step of a pass of ``loader`` through ``stopper``, then
    ``(signum, None)`` where every rank stopped."""
    stops = []
    for batch in stopper.batches(loader, "training", 0, 0, stop=stops.append, **kw):
        yield 0, batch
    if stops:
        yield stops[0], None


def rank_agreements(world):
    import datetime

    import torch.distributed as dist

    from engine.runtime import new_host_group
    from engine.stop import Stopper

    rank = dist.get_rank()
    group = new_host_group(datetime.timedelta(seconds=60))  # lazily connected
    request = _Request()
    stopper = Stopper(request, True, group, every=3)
    decisions, propose_s = [], []
    for index in range(8):
        if rank == world - 1 and index == 1:
            time.sleep(2.0)  # the slowest rank: the others' proposals must not wait for it
        interrupted = 15 if (rank == 2 and index == 5) else 0
        t0 = time.perf_counter()
        stopper.after_fetch(_Reads(), index, interrupted)
        propose_s.append(time.perf_counter() - t0)
        decisions.append(stopper.decision())
    # A recorded signal is proposed at log points only (every 3rd fetch), then decided.
    request.signum = 10 if rank == 1 else 0
    recorded = []
    for index in range(1, 7):
        stopper.after_fetch(_Reads(), index)
        recorded.append(stopper.decision())
    # With a loader that never waits only every 3rd fetch proposes: no collective between.
    before = stopper.proposals
    cached = []
    for index in range(1, 7):
        stopper.after_fetch(_Cached(), index)
        cached.append(stopper.decision())
    return dict(decisions=decisions, propose_s=max(propose_s), recorded=recorded,
                cached=cached, cached_proposals=stopper.proposals - before)


def test_proposals_never_wait_and_every_rank_decides_the_same():
    world = 4
    ranks = run_ranks(rank_agreements, world, world, timeout=120)
    for r in ranks:
        assert r["decisions"] == [0] * 5 + [15] + [0] * 2  # rank 2's interrupted fetch
        assert r["recorded"] == [0, 0, 10, 0, 0, 10]  # at the log points (indices 3 and 6)
        assert r["cached"] == [0, 0, 10, 0, 0, 10] and r["cached_proposals"] == 2
    for r in ranks[:-1]:  # launched without waiting for the slowest rank's 2 s
        assert r["propose_s"] < 1.0, r["propose_s"]


def test_a_stop_request_that_never_agrees_takes_part_in_no_collective():
    from engine.stop import NeverStop, Stopper

    stopper = Stopper(NeverStop(), True)  # no process group exists here
    stopper.after_fetch(_Reads(), 0, interrupted=0)
    assert stopper.decision() == 0 and stopper.proposals == 0
    assert stopper.now(0) == 0 and stopper.decision() == 0


# ----------------------------------------------------------------------------- fetching ahead


class _Pass:
    """A loader's pass of ``n`` batches (0, 1, ...) that notes each fetch; a stop signal ends
    the wait for fetch ``interrupt_at``."""

    def __init__(self, n: int, interrupt_at: int | None = None):
        self.n, self.interrupt_at, self.fetched = n, interrupt_at, []

    def __iter__(self):
        return self

    def __next__(self):
        import signal

        from engine.stop import Interrupted

        i = len(self.fetched)
        if i == self.interrupt_at:
            self.fetched.append("interrupted")
            raise Interrupted(signal.SIGUSR1)
        if i >= self.n:
            raise StopIteration
        self.fetched.append(i)
        return i


def _steps(stopper, batches, **kw):
    """(signum, batch, fetches made so far) at each step of the stopper's pass."""
    return [(signum, batch, len(batches.fetched))
            for signum, batch in _decided(stopper, batches, **kw)]


def test_each_batch_is_fetched_lag_steps_ahead_and_none_past_the_end():
    import signal

    from engine.stop import Stopper

    stopper = Stopper(_Request(), False)
    stopper.lag = 3  # (raised by the ranks' agreement; see below)
    p = _Pass(20)
    assert _steps(stopper, p, end=8) == [(0, k, min(k + 4, 8)) for k in range(8)]
    assert p.fetched == list(range(8))  # nothing for the steps at and past the end
    p = _Pass(5)  # the pass ends first
    assert _steps(stopper, p) == [(0, k, 5) if k else (0, 0, 4) for k in range(5)]
    # A signal ends the wait for step 5's batch: the steps before run, then every rank stops
    # before step 5, and the pass is not asked for another batch.
    p = _Pass(20, interrupt_at=5)
    got = _steps(stopper, p)
    assert [b for _, b, _ in got] == [0, 1, 2, 3, 4, None] and got[-1][0] == signal.SIGUSR1
    assert p.fetched == [0, 1, 2, 3, 4, "interrupted"]


def test_a_recorded_signal_stops_at_the_next_log_point_whatever_the_lag():
    from engine.stop import Stopper

    for lag in (1, 2, 4):
        request = _Request()
        stopper = Stopper(request, False, every=4)
        stopper.lag = lag
        request.signum = 10  # recorded before the pass: an epoch still takes its first steps
        assert [(s, b) for s, b, _ in _steps(stopper, _Pass(20))] == \
            [(0, 0), (0, 1), (0, 2), (0, 3), (10, None)]
        # the throughput report's passes propose a recorded signal at once
        assert [s for s, _, _ in _steps(stopper, _Pass(20), first_recorded=True)] == [10]


RING_S, STEP_S = 0.08, 0.05  # a ring of all-reduce messages longer than a step


def rank_lag(world):
    """Passes of 10 steps of STEP_S with all-reduces that hold one of 2 threads for RING_S on
    rank 3 (as gloo runs a ring of hundreds of ranks: longer than a step) and for 30 ms on the
    others."""
    import datetime
    import statistics

    import torch.distributed as dist

    from engine.runtime import new_host_group
    from distributed_harness import simulate_long_ring
    from engine.stop import Stopper

    rank = dist.get_rank()
    simulate_long_ring(RING_S if rank == 3 else 0.03)
    stopper = Stopper(_Request(), True, new_host_group(datetime.timedelta(seconds=60)))
    passes = []
    for interrupt_at in (None, None, 7 if rank == 2 else None):
        decide = stopper.decision
        waits = []

        def timed(index=None, note=True):
            t0 = time.perf_counter()
            signum = decide(index, note)
            waits.append(time.perf_counter() - t0)
            return signum

        stopper.decision = timed
        p = _Pass(10, interrupt_at)
        lag, steps = stopper.lag, []
        for signum, batch in _decided(stopper, p):
            steps.append((signum, batch))
            time.sleep(STEP_S)
        stopper.decision = decide
        passes.append(dict(lag=lag, steps=steps, fetched=p.fetched,
                           wait=statistics.median(waits[1:])))  # (the first waits for all)
        stopper.now()  # as after a validation: the ranks take the largest lag asked for
    return passes


def test_the_ranks_fetch_further_ahead_when_the_ring_outlasts_a_step():
    import signal

    ranks = run_ranks(rank_lag, 4, 4, timeout=120)
    assert ranks[3][0]["wait"] > 0.01, ranks[3][0]  # rank 3 waited every step
    for r in ranks:
        first, second, third = r
        # rank 3 asked for 2 steps ahead (a ring of 80 ms over steps of 50), the others for
        # none (theirs was hidden): every rank took 2, which hides rank 3's ring too
        assert first["lag"] == 1 and second["lag"] == 2 and second["wait"] < 0.005, second
        assert [b for _, b in first["steps"]] == [b for _, b in second["steps"]] == list(range(10))
        # A signal ends rank 2's wait for step 7's batch: every rank stops before step 7.
        assert third["lag"] == 2 and third["steps"] == [(0, k) for k in range(7)] + [
            (signal.SIGUSR1, None)], third["steps"]
    assert ranks[2][2]["fetched"] == [0, 1, 2, 3, 4, 5, 6, "interrupted"]
    assert all(r[2]["fetched"] == list(range(9)) for r in ranks[:2] + ranks[3:])


# ----------------------------------------------------------------------------- stress


def _scenario(rng, world):
    """One pass, the same on every rank (drawn from the same seed): the lag, the cadence, the
    loader's kind, the pass's length and end, and per rank a wait a signal ends or a signal
    recorded in a step (-1: before the pass; each or none); the pass left after ``abandon``
    steps (as the throughput report's rounds do), or run to its end."""
    every, waits = rng.randint(1, 3), rng.random() < 0.7
    n = rng.randint(1, 14)
    s = dict(every=every, waits=waits, n=n, end=rng.choice([None, rng.randint(0, 16)]),
             first_recorded=rng.random() < 0.3, needed=[], interrupt=[], record=[],
             abandon=rng.randint(1, n) if rng.random() < 0.2 else None)
    for _ in range(world):
        s["needed"].append([rng.randint(0, 6) for _ in range(rng.randint(0, 3))])
        s["interrupt"].append(rng.randint(0, n + 1) if waits and rng.random() < 0.3 else None)
        s["record"].append(rng.randint(-1, n + 1) if rng.random() < 0.3 else None)
    return s


def expected_steps(s, lag, world):
    """The steps every rank runs, and the signal it stops on (0: none), from the rules: a rank
    proposes after each fetch (a loader that waits) or each ``every``-th; a wait ended at
    fetch i stops all before step i; a signal recorded in step t is proposed at the first log
    point fetched after it (the fetch of step j happens before step j - lag runs, so j > t + lag;
    one recorded before the pass at the first log point after the pass's first fetch, or at
    that fetch with ``first_recorded``)."""
    last = min(s["n"], s["end"] if s["end"] is not None else s["n"])  # steps with a batch
    stops = []
    for r in range(world):
        if s["interrupt"][r] is not None and s["interrupt"][r] < last:
            stops.append((s["interrupt"][r], 15))
        t = s["record"][r]
        if t is not None and t < last:
            first = t + lag + 1 if t >= 0 else 0 if s["first_recorded"] else 1
            stops.append((next(j for j in itertools.count(first) if j % s["every"] == 0), 10))
    stops = [(j, sig) for j, sig in stops if j <= last]
    j = min((j for j, _ in stops), default=last)
    if s["abandon"] is not None and s["abandon"] <= j:
        return list(range(s["abandon"])), 0
    return list(range(j)), max((sig for i, sig in stops if i == j), default=0)


def rank_stress(world, scenarios, seed):
    import datetime
    import random
    import signal as signals

    import torch.distributed as dist

    from engine.runtime import new_host_group
    from engine.stop import MAX_LAG, Interrupted, Stopper

    rank = dist.get_rank()
    rng = random.Random(seed)  # the same draws on every rank
    request = _Request()
    stopper = Stopper(request, True, new_host_group(datetime.timedelta(seconds=60)))
    out = []
    for k in range(scenarios):
        s = _scenario(rng, world)
        if k % 10 == 0:
            stopper.lag = rng.randint(1, 4)  # as a new run's (any lag: the mechanics hold)
        stopper.every = s["every"]
        request.signum = signals.SIGUSR1 if s["record"][rank] == -1 else 0
        interrupt, record = s["interrupt"][rank], s["record"][rank]
        fetched = []

        def batches():
            for i in range(s["n"]):
                if i == interrupt:
                    fetched.append("interrupted")
                    raise Interrupted(signals.SIGTERM)
                fetched.append(i)
                yield i

        loader = _Over(batches(), never_waits=not s["waits"])
        steps, signum, lag = [], 0, stopper.lag
        for signum, batch in _decided(stopper, loader, end=s["end"],
                                      first_recorded=s["first_recorded"]):
            if signum:
                break
            assert batch == len(steps), (batch, steps)  # this step's own batch, in order
            steps.append(batch)
            if batch == record:
                request.signum = signals.SIGUSR1  # recorded in this step
            if len(steps) == s["abandon"]:
                break  # proposals stay in flight: the next pass starts after them
        else:
            assert not stopper._pending  # nothing in flight after a pass
        if k % 3 == 2:  # as after a validation: each rank asks for the median of its needs
            before = stopper.lag
            stopper._needed = list(s["needed"][rank])
            stopper.now()
            asked = [sorted(v)[(len(v) - 1) // 2] if v else 0 for v in s["needed"]]
            assert stopper.lag == max(before, min(MAX_LAG, max(asked))), (stopper.lag, asked)
        out.append(dict(steps=steps, signum=signum, lag=lag, fetched=fetched, scenario=s))
    return out


def test_stress_every_rank_runs_the_same_steps_and_stops_where_the_rules_say():
    """300 random passes on 3 gloo ranks (lags 1-4, cadences 1-3, loaders that wait or not,
    passes that end early, are cut by ``end`` or are left before their end, a wait ended or a
    signal recorded on any ranks), the lag raised every third pass as after a validation (the
    passes between start with proposals of the pass before in flight): every rank runs the same steps
    with its own batches, stops before the same step on the same signal as the rules give,
    fetches nothing after a wait a signal ended, nor past ``end``, nor more than ``lag`` steps
    ahead, and leaves nothing in flight."""
    import signal as signals

    world = 3
    ranks = run_ranks(rank_stress, world, world, 300, 20261127, timeout=240)
    lags = set()
    for k in range(300):
        passes = [r[k] for r in ranks]
        s, lag = passes[0]["scenario"], passes[0]["lag"]
        lags.add(lag)
        assert all(p["lag"] == lag for p in passes)
        steps, signum = expected_steps(s, lag, world)
        want = {0: 0, 15: signals.SIGTERM, 10: signals.SIGUSR1}[signum]
        for r, p in enumerate(passes):
            assert (p["steps"], p["signum"]) == (steps, want), (k, r, s, lag, p)
            cut = [i for i in p["fetched"] if i != "interrupted"]
            assert p["fetched"][len(cut):] in ([], ["interrupted"])  # nothing after it
            assert len(cut) <= min(len(steps) + lag, s["end"] if s["end"] is not None else 99)
    assert lags == {1, 2, 3, 4}  # every lag was played


# ----------------------------------------------------------------------------- the stopper


class _Listed(list):  # a loader that may wait: a pass is the list
    pass


def test_the_stopper_stops_a_pass_in_one_call_and_agrees_after_a_validation():
    """``Stopper.batches`` yields each step's batch and calls ``stop`` once where the ranks agree
    (a signal recorded in step 2 is proposed at the log point of step 4, whose batch was fetched
    after it); ``validation_batches`` gives each forward its batch, None after a wait a signal
    ended; ``stop_agreed`` then stops on that signal. A batch past the sizes, or no forward at
    all, is a TrainingError."""
    import signal

    from settings.errors import TrainingError

    from engine.stop import Interrupted, Stopper

    request = _Request()
    stopper = Stopper(request, False, every=2)
    steps, stops = [], []
    for batch in stopper.batches(_Listed(range(10)), "training", 0, 0, stop=stops.append):
        steps.append(batch)
        if batch == 2:
            request.signum = signal.SIGUSR1
    assert steps == [0, 1, 2, 3] and stops == [signal.SIGUSR1]

    class Interrupting(list):
        def __iter__(self):
            yield self[0]
            raise Interrupted(signal.SIGTERM)

    request.signum = 0
    got = list(stopper.validation_batches(Interrupting("ab"), 0, [2, 2, 1], 5))
    assert got == [(2, "a"), (2, None), (1, None)] and stopper.stop_agreed() == signal.SIGTERM
    got = []
    with pytest.raises(TrainingError, match=r"_Listed gave more batches than its shard of 2 "
                                            r"samples holds \(2\)"):
        got.extend(stopper.validation_batches(_Listed("xyz"), 0, [1, 1], 2))
    assert got == [(1, "x"), (1, "y")] and stopper.stop_agreed() == 0
    with pytest.raises(TrainingError, match="the validation set is empty"):
        list(stopper.validation_batches(_Listed(""), 0, [], 0))
    stopper.close()
