"""An SGLang pool of two prefill and two decode workers with one worker of each role broken: a
stuck prefill worker (its decode legs answer 500 while its leg is out) and a decode worker
answering 500 to every pair. Each fails with both workers of the other role, one of which is the
other broken worker, which never serves: triangulation has one working partner to go on for
each, and the one-partner rule weighs them (`gateway.pd_suspects`, "One partner": a failure
with a partner that has not served since says nothing of the worker)."""

from __future__ import annotations

from tests.gateway.sglang_fleet import Fleet, sglang_rig

CONNECT_S = 0.25  # each inconclusive round waits this long for its prefill leg


async def test_a_stuck_prefill_worker_and_a_broken_decode_worker_both_have_their_breakers_opened() -> None:
    """p1 is stuck and d2 answers 500 to every pair; p2 and d1 serve each other's pairs. Both
    broken workers' breakers open, and the healthy workers' count no failure; then requests go
    to the healthy pair alone."""
    fleet = Fleet(broken="p1", prefill_fault="stuck", failing=lambda prefill, decode: decode == "d2")
    async with sglang_rig(fleet, prefills=2, decodes=2, connect_s=CONNECT_S) as rig:
        for _ in range(120):  # a request all of whose rounds meet a broken worker is not served
            await rig.chat()
            assert rig.breaker("p2").failures == rig.breaker("d1").failures == 0
            if not rig.breaker_closed("p1") and not rig.breaker_closed("d2"):
                break
        assert not rig.breaker_closed("p1") and not rig.breaker_closed("d2")
        assert rig.breaker_closed("p2") and rig.breaker_closed("d1")
        failed = len(fleet.failed)
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert len(fleet.failed) <= failed + 2  # a half-open trial each at most
