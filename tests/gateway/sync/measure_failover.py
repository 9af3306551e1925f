"""How long two gateways' sync takes to follow a Redis Sentinel failover, on loopback servers.

`python -m tests.gateway.sync.measure_failover --repeats 5 [--kill]`: a primary, a replica and
one sentinel (down-after 500 ms, failover-timeout 2 s), two `SyncService`s on `redis+sentinel://`;
each round requests `SENTINEL FAILOVER` (or, with `--kill`, SIGKILLs the primary, and starts it
again as a replica of the new one afterwards) and prints, from that moment, when the sentinels
named the new primary, when each link was on it, and when a dispatch made after both moved
reached the other gateway both ways. Every process is stopped by PID on the way out."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gateway.sync.broker import LocalRedis
from gateway.sync.sentinel_link import SentinelLink
from gateway.sync.service import SyncService
from policies.base import RouteDecision, WorkerId
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.sentinels import kill, sentinel_set
from tests.gateway.sync.test_redis_broker import _service
from tests.gateway.sync.test_service_nats import W
from tests.policies.factories import req
from tests.support.wait import wait_until


async def _round(deployment, a: SyncService, b: SyncService, n: int, crash: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    links = [a.link, b.link]
    assert all(isinstance(link, SentinelLink) for link in links)
    old = await deployment.primary()
    started = time.monotonic()
    if crash:
        kill(deployment.server_at(old))
        new = await deployment.moved_from(old)
    else:
        new = await deployment.failover()
    switched = time.monotonic() - started
    moved: dict[int, float] = {}

    def on_new() -> bool:
        for i, link in enumerate(links):
            if i not in moved and link.connected and link.primary == new:  # type: ignore[attr-defined]
                moved[i] = time.monotonic() - started
        return len(moved) == 2

    await wait_until(on_new, timeout_s=30, interval_s=0.005)
    for sender, receiver, side in ((a, b, "ab"), (b, a, "ba")):
        items = receiver.subscriber.stats.items
        r = req(f"{side}{n}", range(64), pool="p")
        sender.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[0]), 0.0, "miss"), time.monotonic())
        await wait_until(lambda: receiver.subscriber.stats.items > items, interval_s=0.002)  # noqa: B023
    flowing = time.monotonic() - started
    if crash:  # the killed one comes back as a replica, ready for the next round
        server = deployment.server_at(old)
        deployment.servers.remove(server)
        folder = Path(server.log_dir) / f"again-{n}"
        folder.mkdir()
        again = LocalRedis(old.port, folder, replica_of=new.port)
        deployment.servers.append(again)
        again.start()
    return {"switch": switched, "first": min(moved.values()), "both": max(moved.values()), "flow": flowing}


async def main(repeats: int, crash: bool) -> None:
    # A sentinel starts no failover of a primary within twice its failover-timeout of the last
    # one unless asked (SENTINEL FAILOVER is asked); the rounds of --kill wait that out.
    timeout_ms = 2000
    with (
        tempfile.TemporaryDirectory() as tmp,
        sentinel_set(Path(tmp), failover_timeout_ms=timeout_ms) as deployment,
    ):
        url = deployment.url(with_dead_first=False)
        a, b = _service(url, "a"), _service(url, "b")
        async with running_services(a, b):
            await wait_until(lambda: a.link.connected and b.link.connected)
            rounds = []
            for n in range(repeats):
                result = await _round(deployment, a, b, n, crash)
                rounds.append(result)
                print(f"round {n}: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.items()), flush=True)
                await asyncio.sleep(2 * timeout_ms / 1000 if crash else 1.0)
            for key in rounds[0]:
                values = [r[key] for r in rounds]
                print(f"{key}: median {statistics.median(values):.2f} s, max {max(values):.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kill", action="store_true", help="SIGKILL the primary instead of SENTINEL FAILOVER"
    )
    args = parser.parse_args()
    asyncio.run(main(args.repeats, args.kill))
