"""A canary on a kept-alive connection the worker is closing (`gateway/canary.py`).

uvicorn closes a connection idle for 5 s, the gateway's client keeps one for 30 s: a canary
sent on a pooled connection as the worker closes it ends before any byte of an answer, and the
worker never saw it. Judged so, a healthy worker failed its canary: a half-open breaker opened
again at once, and a closed one counted a failure. The canary is then sent once more, on a
fresh connection, as the lean client resends a request its worker closed unseen
(`gateway/upstream.py`); a worker that drops every connection still fails it."""

from __future__ import annotations

from gateway.canary import CanaryVerdict
from tests.gateway.canary_rig import POISON, WAIT_S, gateway
from tests.support.wait import wait_until


async def test_a_canary_on_a_connection_the_worker_closed_unseen_is_sent_again() -> None:
    # Opens at the first failure counted: a spurious failed canary shows as an open breaker.
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.drops = "reused"
        counts = rig.canaries.counts
        for _ in range(3):  # the first canary opens the connection the next ones find kept
            ended = counts.total()
            assert (await rig.chat(POISON)).status_code == 502
            await wait_until(lambda: counts.total() > ended, timeout_s=WAIT_S, what="its canary ended")  # noqa: B023
        assert rig.workers.dropped >= 1  # a canary did find a kept-alive connection closing
        assert counts == {CanaryVerdict.PASSED: 3} and rig.closed("a")
        assert (await rig.chat(tenant="u")).status_code == 200


async def test_a_worker_that_drops_every_connection_fails_its_canary() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.drops = "all"
        assert (await rig.chat(POISON)).status_code == 502
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 1 and rig.workers.canaries == []
