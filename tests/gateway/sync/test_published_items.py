"""`kvgate_sync_events_total{event="published_items"}` is a counter: it counts the items of the
batches the link took, once it took them, so a scrape while a publish is under way (one that then
fails) never reads more than a later scrape."""

from __future__ import annotations

import asyncio

from gateway.config import parse_config
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.state import build_state
from gateway.sync.service import SyncService
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding
from prompt_normalizer.normalizer import NormalizerConfig
from tests.policies.factories import BS, req
from tests.support.gateway_config import tenant
from tests.support.wait import wait_until

W = "http://127.0.0.1:9100"


class _HeldLink:
    """A link whose publishes wait for `release` and then answer `taken`."""

    connected = True
    max_payload = 1 << 20
    slow_consumer = errors = connects = 0

    def __init__(self) -> None:
        self.publishing = False
        self.release = asyncio.Event()
        self.taken = True

    async def publish(self, data: bytes) -> bool:
        self.publishing = True
        try:
            await self.release.wait()
        finally:
            self.publishing = False
        self.release.clear()
        return self.taken


def _service() -> SyncService:
    config = parse_config(
        {
            "pools": [PoolConfig(name="p", models=["m"], workers=[W]).model_dump()],
            "tenants": [tenant("t", "sk-t")],
            "sync": SyncConfig(url="nats://127.0.0.1:1", batch_interval_s=0.001).model_dump(),
        }
    )
    state = build_state(config, b"secret", CostPolicy(seed=0), NormalizerConfig())
    return SyncService(state.registry, state.routing, config.sync, "a", secret=state.secret)


def _queue(service: SyncService, refs: range) -> None:
    for ref in refs:
        holding = PeerHolding(ref, "p", BS, "t", req(f"r{ref}", range(4)).block_keys, WorkerId(W), 64, 0)
        service.publisher.sink(holding, 0.0)


def _published_items(service: SyncService) -> int:
    service.refresh_metrics()
    text = service.routing.metrics.render().decode()
    series = 'kvgate_sync_events_total{event="published_items"}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    return int(float(line.split()[-1]))


async def _publish_once(service: SyncService, link: _HeldLink, taken: bool) -> list[int]:
    """Publish what is queued through `link`, answering `taken`; the counts read while the
    publish waited and after it."""
    link.taken = taken
    task = asyncio.create_task(service._send(0.0))
    await wait_until(lambda: link.publishing, what="the publish under way")
    during = _published_items(service)
    link.release.set()
    await task
    return [during, _published_items(service)]


async def test_published_items_counts_taken_batches_and_never_goes_down() -> None:
    service = _service()  # never started: the held link publishes
    link = _HeldLink()
    service.link = link  # type: ignore[assignment]
    _queue(service, range(1, 3))
    seen = [_published_items(service), *await _publish_once(service, link, taken=True)]
    _queue(service, range(3, 6))
    seen += await _publish_once(service, link, taken=False)  # a full buffer, a link that dropped
    assert seen == [0, 0, 2, 2, 2], seen
    assert service.counters()["dropped_publish_failed"] == 3
    _queue(service, range(6, 7))
    assert await _publish_once(service, link, taken=True) == [2, 3]
