"""SGLang pools with one prefill worker, or one decode worker, and one worker failing so that its
pairs are inconclusive (`gateway.pd_suspects`, "One partner"): the broken worker of the pair has
its breaker opened after a few rounds, through its partner's probes; a partner that fails only
now and then never gets the other worker blamed (it fails the probe); with one worker of each
role nothing is compared, so nobody is blamed."""

from __future__ import annotations

import time

import pytest

from gateway.pd_suspects import NO_SUSPECTS, PROBES, SUSPECT_ROUNDS, Suspects
from policies.base import WorkerId
from tests.gateway.sglang_fleet import Fleet, Rig, sglang_rig

CONNECT_S = 0.25  # each inconclusive round waits this long for its prefill leg


async def _until_open(rig: Rig, name: str, limit: int = 80) -> None:
    """Requests, each served, until `name`'s breaker opens."""
    for _ in range(limit):
        resp = await rig.chat()
        assert resp.status_code == 200, resp.text
        if not rig.breaker_closed(name):
            return
    raise AssertionError(f"{name}'s breaker did not open in {limit} requests")


async def test_with_one_prefill_worker_a_decode_worker_answering_500_has_its_breaker_opened() -> None:
    """It fails each pair before its prefill leg has ended, so each such round is inconclusive;
    the prefill worker serves the request with the other decode worker. Once suspect, the decode
    worker is avoided while the prefill worker passes its probes with the other one; its retrial
    fails and convicts it, and no later request meets it."""
    fleet = Fleet(broken="d1")
    async with sglang_rig(fleet, prefills=1, decodes=2, connect_s=CONNECT_S) as rig:
        await _until_open(rig, "d1")
        assert rig.breaker_closed("p1") and rig.breaker_closed("d2")
        assert fleet.decode_legs == SUSPECT_ROUNDS + 1  # the rounds it cost: the streak's
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert fleet.decode_legs <= SUSPECT_ROUNDS + 2  # a half-open trial at most


async def test_with_one_decode_worker_a_stuck_prefill_worker_has_its_breaker_opened() -> None:
    """A prefill worker that answers nothing and sends no KV: its decode legs answer 500 while
    its leg is out, and the other prefill worker serves each request with the same decode
    worker, whose breaker stays closed."""
    fleet = Fleet(broken="p1", prefill_fault="stuck")
    async with sglang_rig(fleet, prefills=2, decodes=1, connect_s=CONNECT_S) as rig:
        await _until_open(rig, "p1")
        assert rig.breaker_closed("p2") and rig.breaker_closed("d1")
        assert fleet.prefill_legs == SUSPECT_ROUNDS + 1
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert fleet.prefill_legs <= SUSPECT_ROUNDS + 2


@pytest.mark.parametrize("shape", ["3:1", "1:3"])
async def test_two_broken_workers_sharing_their_one_partner_have_their_breakers_opened(shape: str) -> None:
    """Two prefill workers whose every pair with the one decode worker is inconclusive (or two
    decode workers answering 500 to every pair of the one prefill worker): the third worker of
    their role serves each request. Neither broken worker's failures clear the other's (their
    partner failing with a worker that never serves shows nothing about the partner)."""
    prefills, decodes = map(int, shape.split(":"))
    broken = ("p1", "p2") if prefills == 3 else ("d1", "d2")
    pairs = {("p1", "d1"), ("p2", "d1")} if prefills == 3 else {("p1", "d1"), ("p1", "d2")}
    fleet = Fleet(failing=lambda prefill, decode: (prefill, decode) in pairs)
    async with sglang_rig(fleet, prefills=prefills, decodes=decodes, connect_s=CONNECT_S) as rig:
        for name in broken:
            await _until_open(rig, name)
        healthy = ("p3", "d1") if prefills == 3 else ("p1", "d3")
        assert all(rig.breaker(name).failures == 0 for name in healthy)
        failed = len(fleet.failed)
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert len(fleet.failed) <= failed + 2  # a half-open trial each at most


async def test_a_request_whose_partner_failed_with_two_workers_clears_the_suspect_at_its_retrial() -> None:
    """The one decode worker fails with p1 only until p1 is suspected, then with none while p1 is
    probed; then it has a bad spell: it fails with p1 at p1's retrial, and with the next prefill
    worker of that request, which works (it served probes). The request's rounds are weighed
    together: the decode worker failing without p1 clears p1, though its round came first."""
    bad_spell = after_p1 = False

    def failing(prefill: str, _: str) -> bool:
        nonlocal after_p1
        failed = prefill == "p1" or after_p1
        after_p1 = bad_spell and prefill == "p1"
        return failed

    fleet = Fleet(failing=failing)
    async with sglang_rig(fleet, prefills=3, decodes=1, connect_s=CONNECT_S) as rig:
        pool = rig.state.registry.pools["p"]

        def suspected() -> Suspects:
            return pool.pd_suspects.suspected(time.monotonic(), pool.workers)

        for _ in range(30):
            if suspected() != NO_SUSPECTS:
                break
            assert (await rig.chat()).status_code == 200
        assert suspected().prefill == {WorkerId(rig.urls["p1"])}
        fleet.failing = lambda prefill, decode: False
        for _ in range(PROBES + 10):
            if suspected() == NO_SUSPECTS:
                break
            assert (await rig.chat()).status_code == 200
        assert suspected() == NO_SUSPECTS  # on to p1's retrial
        bad_spell = True
        fleet.failing = failing
        failed = len(fleet.failed)
        for _ in range(20):
            assert (await rig.chat()).status_code == 200
            if ("p1", "d1") in fleet.failed[failed:]:
                break
        first, second = fleet.failed[failed:]  # the request's rounds: p1's, then another's
        assert first == ("p1", "d1") and second[0] != "p1"
        assert rig.breaker("p1").failures == 0 and rig.breaker_closed("p1")


async def test_with_one_decode_worker_failing_every_other_pair_no_prefill_worker_is_blamed() -> None:
    """The decode worker fails every request's first round, which the policy gives the same
    prefill worker each time, and serves the retry with the other one: what a broken prefill
    worker looks like. The probe tells: once that prefill worker is avoided, the decode worker
    fails with the other one first. No prefill worker ever counts a failure."""
    fleet = Fleet(broken="d1", now_and_then=True)
    async with sglang_rig(fleet, prefills=2, decodes=1, connect_s=CONNECT_S) as rig:
        for _ in range(24):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
            assert rig.breaker("p1").failures == rig.breaker("p2").failures == 0
        assert {("p1", "d1"), ("p2", "d1")} <= set(fleet.failed)  # a probe ran


async def test_with_one_prefill_worker_failing_every_other_pair_no_decode_worker_is_blamed() -> None:
    """The same with the roles swapped: the prefill worker sends no KV for every other leg (its
    decode leg answers 500 while it is out), so each request's first round fails, on the decode
    worker the policy prefers. Neither decode worker ever counts a failure."""
    fleet = Fleet(broken="p1", prefill_fault="now_and_then")
    async with sglang_rig(fleet, prefills=1, decodes=2, connect_s=CONNECT_S) as rig:
        for _ in range(24):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
            assert rig.breaker("d1").failures == rig.breaker("d2").failures == 0
        assert {("p1", "d1"), ("p1", "d2")} <= set(fleet.failed)  # a probe ran


@pytest.mark.parametrize("broken", ["d1", "p1"])
async def test_with_one_worker_of_each_role_nobody_is_blamed(broken: str) -> None:
    """Either worker failing every other pair: the retry, on the same pair, serves, and neither
    worker has another partner to compare with."""
    fleet = Fleet(broken=broken, now_and_then=True, prefill_fault="now_and_then")
    async with sglang_rig(fleet, prefills=1, decodes=1, connect_s=CONNECT_S) as rig:
        for _ in range(12):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
            assert rig.breaker("p1").failures == rig.breaker("d1").failures == 0
        assert len(fleet.failed) >= 6
