"""The ranks' stop agreement (engine.stop_agreement) on real gloo ranks: a proposal never waits
for the peers, the decision is the same on every rank, and the cadence is the same on every
rank whatever the loader."""
import time

from distributed_harness import run_ranks


class _Request:
    agrees = True

    def __init__(self):
        self.signum = 0


class _Reads:  # a loader that may wait
    pass


class _Cached:  # one that never waits
    never_waits = True


def rank_agreements(world):
    import datetime

    import torch.distributed as dist

    from engine.runtime import new_host_group
    from engine.stop_agreement import StopAgreement

    rank = dist.get_rank()
    group = new_host_group(datetime.timedelta(seconds=60))  # lazily connected
    request = _Request()
    agreement = StopAgreement(request, True, group, every=3)
    decisions, propose_s = [], []
    for index in range(8):
        if rank == world - 1 and index == 1:
            time.sleep(2.0)  # the slowest rank: the others' proposals must not wait for it
        interrupted = 15 if (rank == 2 and index == 5) else 0
        t0 = time.perf_counter()
        agreement.after_fetch(_Reads(), index, interrupted)
        propose_s.append(time.perf_counter() - t0)
        decisions.append(agreement.decision())
    # A recorded signal is proposed at log points only (every 3rd fetch), then decided.
    request.signum = 10 if rank == 1 else 0
    recorded = []
    for index in range(1, 7):
        agreement.after_fetch(_Reads(), index)
        recorded.append(agreement.decision())
    # With a loader that never waits only every 3rd fetch proposes: no collective between.
    before = agreement.proposals
    cached = []
    for index in range(1, 7):
        agreement.after_fetch(_Cached(), index)
        cached.append(agreement.decision())
    return dict(decisions=decisions, propose_s=max(propose_s), recorded=recorded,
                cached=cached, cached_proposals=agreement.proposals - before)


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
    from engine.preemption import NeverStop
    from engine.stop_agreement import StopAgreement

    agreement = StopAgreement(NeverStop(), True)  # no process group exists here
    agreement.after_fetch(_Reads(), 0, interrupted=0)
    assert agreement.decision() == 0 and agreement.proposals == 0
    assert agreement.now(0) == 0 and agreement.decision() == 0
