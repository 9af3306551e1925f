"""SGLang's two legs of a split, each worker answering for itself.

The gateway runs in-process in front of scripted SGLang prefill and decode workers
(`tests.gateway.sglang_fleet`), one of which may be scripted to fail: a decode worker that
answers 500 to everything, or a prefill worker that never answers (until the test ends) or
answers 500. A worker failing in a pool with one prefill (or decode) worker is in
`test_pd_one_partner.py`.
"""

from __future__ import annotations

import pytest

from policies.base import WorkerId
from tests.gateway.sglang_fleet import Fleet, sglang_rig
from tests.support.wait import wait_until


async def test_a_decode_worker_answering_500_is_left_out_then_its_breaker_opens() -> None:
    """It answers 500 before its prefill leg has ended (the prefill worker waits for it to join
    the room), so either could be at fault: no verdict on either then, and the next round goes
    without both, which serves it. Once it has so failed with both prefill workers, each of which
    serves pairs with the other decode worker, it is shown at fault: its breaker counts those
    rounds and opens, and no more requests pay a round for it."""
    async with sglang_rig(Fleet(broken="d1"), prefills=2) as rig:
        for _ in range(64):  # until it opens: each request meets d1 or not as the policy chooses
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
            if not rig.breaker_closed("d1"):
                break
        assert not rig.breaker_closed("d1")
        assert rig.breaker_closed("d2") and rig.breaker_closed("p1") and rig.breaker_closed("p2")
        failed = rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error")
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") <= failed + 1


@pytest.mark.parametrize("status", [500, 503, 529])
async def test_a_decode_worker_failing_now_and_then_gets_no_prefill_worker_blamed(status: int) -> None:
    """Two prefill workers and one decode worker that answers `status` to every other leg: the
    prefill workers are never blamed for it (each fails with one partner only). A 500 leaves the
    round inconclusive and the next one, on the same decode worker, serves the request; an
    overloaded decode worker's 503 or 529 is its own failure, not a transfer's, and with no other
    decode worker the client gets the 503 (`Retry-After`, to come back later)."""
    fleet = Fleet(broken="d1", decode_status=status, now_and_then=True)
    async with sglang_rig(fleet, prefills=2, decodes=1) as rig:
        for _ in range(12):
            resp = await rig.chat()
            assert resp.status_code == 200 or (status != 500 and resp.status_code == 503), resp.text
        assert rig.breaker_closed("p1") and rig.breaker_closed("p2")
        transfers = rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error")
        assert (transfers == 0) == (status != 500)


async def test_a_stuck_prefill_worker_does_not_get_the_decode_workers_blamed() -> None:
    """A prefill worker that is up but answers nothing and sends no KV: the decode legs paired
    with it answer 500 while its leg is still out. The decode workers get no verdict (blaming them
    opened every decode breaker and the pool answered 503), and each such request is served by
    the next round, on the other prefill worker."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="stuck"), prefills=2, read_s=10) as rig:
        for _ in range(6):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        assert rig.breaker_closed("d1") and rig.breaker_closed("d2")
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") >= 1
        # The decode workers serving pairs with the other prefill worker settle it: the stuck one
        # is at fault, and its breaker opens.
        assert not rig.breaker_closed("p1") and rig.breaker_closed("p2")


async def test_a_decode_answer_500_after_its_prefill_worker_went_down_blames_the_transfer() -> None:
    """The prefill worker's bootstrap server is down: its decode legs answer 500 at once, and its
    own leg fails just after. The transfer failed: the next round goes without that prefill
    worker, and the decode workers are not blamed."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="dead"), prefills=2) as rig:
        for _ in range(6):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        assert rig.breaker_closed("d1") and rig.breaker_closed("d2")
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") >= 1
        assert rig.metric("kvgate_pd_leg_failures_total", role="prefill") >= 1
        # Both legs of a failed round failed: one retry, as the retries counter says.
        rig.lines.flush()
        retries = sum(line["retries"] for line in rig.lines.records)
        assert retries == rig.metric("kvgate_upstream_retries_total") >= 1
        assert max(line["retries"] for line in rig.lines.records) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_the_decode_answer_does_not_wait_for_the_prefill_answer(stream: bool) -> None:
    """The prefill worker moved the KV (its decode leg answers) but does not answer: the client
    gets the decode answer at once, reporting the decode worker's `cached_tokens` (the prefill
    answer's is not known yet). The prefill leg is closed on its own when it times out, with no
    verdict on its worker, and the request has one access line."""
    fleet = Fleet(broken="p1", prefill_fault="hang")
    async with sglang_rig(fleet, read_s=1.5) as rig:
        resp = await rig.chat(stream)
        assert resp.status_code == 200
        assert '"cached_tokens":7' in resp.text.replace(" ", "")
        prefill = rig.state.registry.pools["p"].workers[WorkerId(rig.urls["p1"])]
        assert prefill.in_flight == 1  # the answer came while the prefill leg is still read
        await wait_until(lambda: prefill.in_flight == 0, what="the prefill leg closed")
        assert rig.breaker_closed("p1")
        assert rig.metric("kvgate_pd_leg_failures_total") == 0
        # When the KV was ready is not known: the transfer is not timed (from the decode leg's
        # dispatch it would count the prompt's own prefill as transfer).
        assert rig.metric("kvgate_pd_transfer_seconds_count") == 0
        rig.lines.flush()
        assert len(rig.lines.records) == 1 and rig.lines.records[0]["status"] == 200


async def test_a_prefill_answer_in_time_reports_its_cached_tokens() -> None:
    async with sglang_rig(Fleet(prefill_cached=5)) as rig:
        for stream in (True, False):
            resp = await rig.chat(stream)
            assert resp.status_code == 200
            assert '"cached_tokens":5' in resp.text.replace(" ", "")


async def test_a_failed_prefill_leg_is_the_502s_worker() -> None:
    """The only prefill worker answers 500 (its decode leg is stopped): no pair is left, and the
    access line names the prefill worker and its failure, not the decode leg that was stopped."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="500")) as rig:
        resp = await rig.chat()
        assert resp.status_code == 502
        rig.lines.flush()
        (line,) = rig.lines.records
        assert line["worker"] == rig.urls["p1"] and line["error_detail"] == "worker answered 500"
        assert line["retries"] == 0


async def test_a_prefill_leg_still_read_apart_is_closed_when_the_gateway_stops() -> None:
    """The decode answers went out; their prefill legs still wait on a worker that does not
    answer. Stopping the gateway closes them (no verdict) before its books and transport close,
    instead of leaving them to end on a stopped gateway."""
    fleet = Fleet(broken="p1", prefill_fault="hang")
    async with sglang_rig(fleet, read_s=30) as rig:
        for _ in range(3):
            assert (await rig.chat()).status_code == 200
        routing = rig.state.routing
        prefill = rig.state.registry.pools["p"].workers[WorkerId(rig.urls["p1"])]
        assert len(routing.background) == 3 and prefill.in_flight == 3
    assert not routing.background and prefill.in_flight == 0
    assert prefill.breaker.closed
