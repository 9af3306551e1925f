"""Two real gateway processes sharing one broker, each kind in turn (nats-server, redis-server, a
redis-server found through a Redis Sentinel, and the nodes of a Redis Cluster, each gateway on a
different node), in front of emulated workers (approximate mode, no
KV events): what gateway A routes, gateway B routes to the same worker; the broker carries keys
and counts, never the prompt; requests reaching both at once part over the gateways' home shares,
and long prompts among them are held while the short ones are placed; with the broker killed both
keep serving, and when it returns they share again."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.sync.broker import LocalRedis, LocalSentinel
from tests.e2e.harness import Proc, free_port, start, start_gateway, tenant, wait_http, write_gateway_config
from tests.gateway.sync.brokers import BROKERS, TestBroker, capture, local_broker
from tests.gateway.sync.clusters import cluster_nodes, cluster_ok, form_cluster
from tests.support.wait import wait_until_sync

KEY = "sk-sync-e2e"
SUBJECT = "kvgate.e2e"


class SentinelBroker:
    """A redis-server primary and a sentinel that names it: the gateways' `sync.url` is the
    sentinel's (`redis+sentinel://`), and stopping or starting the broker is the primary's."""

    def __init__(self, log_dir: Path) -> None:
        (log_dir / "primary").mkdir()
        (log_dir / "sentinel").mkdir()
        self.primary = LocalRedis(free_port(), log_dir / "primary")
        self.sentinel = LocalSentinel(free_port(), log_dir / "sentinel", self.primary.port)

    @property
    def url(self) -> str:
        return self.primary.url

    @property
    def sync_url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.sentinel.master}"

    def start(self) -> None:
        self.primary.start()

    def stop(self) -> None:
        self.primary.stop()


class ClusterBroker:
    """Three redis-server nodes of one Redis Cluster: gateway i's `sync.url` names them from node
    i on (`redis+cluster://`), so the two gateways are on different nodes and share over the
    cluster bus; stopping or starting the broker is every node's (started again, the nodes rejoin
    from their cluster config, and the start waits until the cluster is ok)."""

    def __init__(self, log_dir: Path) -> None:
        self.nodes = cluster_nodes(log_dir)

    @property
    def url(self) -> str:
        return self.nodes[0].url  # a subscriber on any node hears every node's publications

    def sync_url(self, gateway: int) -> str:
        ports = [n.port for n in self.nodes[gateway:] + self.nodes[:gateway]]
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def start(self, form: bool = False) -> None:
        for node in self.nodes:
            node.start()
        asyncio.run(form_cluster(self.nodes) if form else cluster_ok(self.nodes))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


AnyBroker = TestBroker | SentinelBroker | ClusterBroker


@dataclass
class Pair:
    broker: AnyBroker
    gateways: list[str]
    procs: list[Proc]
    metrics_urls: dict[str, str]  # gateway base URL -> its own metrics listener

    def metric(self, base: str, name: str) -> float:
        text = httpx.get(self.metrics_urls[base] + "/metrics", timeout=5).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def sync_state(self) -> str:
        """Each gateway's sync and herd series, for a failure's message."""
        lines = []
        for base in self.gateways:
            text = httpx.get(self.metrics_urls[base] + "/metrics", timeout=5).text
            ours = [ln for ln in text.splitlines() if ln.startswith(("kvgate_sync", "kvgate_policy_events"))]
            lines += [f"{base}:", *ours]
        return "\n".join(lines)

    def wait_metric(self, base: str, name: str, ok: Callable[[float], bool], timeout_s: float = 20.0) -> None:
        wait_until_sync(lambda: ok(self.metric(base, name)), timeout_s, f"{name} at {base}")


@pytest.fixture(scope="module", params=[*BROKERS, "sentinel", "cluster"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("sync")
    broker: AnyBroker
    procs: list[Proc] = []
    if request.param == "sentinel":
        broker = SentinelBroker(tmp)
        broker.start()
        broker.sentinel.start()
        sync_urls = [broker.sync_url] * 2
    elif request.param == "cluster":
        broker = ClusterBroker(tmp)
        sync_urls = [broker.sync_url(0), broker.sync_url(1)]
    else:
        broker = local_broker(request.param, tmp)
        sync_urls = [broker.url] * 2
    try:
        if isinstance(broker, ClusterBroker):
            broker.start(form=True)  # inside the try: the nodes are stopped if it fails
        urls = []
        for i in range(3):
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "loadtest.emulator",
                "--port",
                str(port),
                "--model",
                "m",
                "--seed",
                str(i),
            ]
            procs.append(start(argv))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health", procs[-1])
        pools = [
            {"name": "p", "models": ["m"], "workers": urls, "health": {"interval_s": 0.5, "timeout_s": 3}}
        ]
        bases, metrics_urls = [], {}
        for i, sync_url in enumerate(sync_urls):
            sync = {"url": sync_url, "subject_prefix": SUBJECT, "batch_interval_s": 0.002}
            path = Path(tmp) / f"gateway-{i}.yaml"
            config = write_gateway_config(path, pools, [tenant("t", KEY)], sync=sync)
            port, metrics_port = free_port(), free_port()
            procs.append(start_gateway(config, port, metrics_port))
            bases.append(f"http://127.0.0.1:{port}")
            metrics_urls[bases[-1]] = f"http://127.0.0.1:{metrics_port}"
        yield Pair(broker, bases, procs, metrics_urls)
    finally:
        for proc in reversed(procs):
            proc.stop()
        broker.stop()
        if isinstance(broker, SentinelBroker):
            broker.sentinel.stop()


def _ask(base: str, system: str, question: str) -> int:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    resp = httpx.post(
        base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    cached: int = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_a_prompt_routed_by_one_gateway_is_routed_to_the_same_worker_by_the_other(pair: Pair) -> None:
    a, b = pair.gateways
    for base in (a, b):
        pair.wait_metric(base, "kvgate_sync_peers", lambda v: v == 1)
    captured: list[bytes] = []

    async def run() -> None:
        ready, done = asyncio.Event(), asyncio.Event()
        capturing = asyncio.create_task(capture(pair.broker.url, f"{SUBJECT}.batches", ready, done, captured))
        await ready.wait()
        applied = 'kvgate_sync_events_total{event="applied_items"}'

        async def ask(base: str, system: str, question: str) -> int:
            """One request at a time: it is answered, and its dispatch and outcome reached the
            other gateway, before the next is decided (no decision misses the other's last one)."""
            other = b if base == a else a
            target = await asyncio.to_thread(pair.metric, other, applied) + 2
            cached = await asyncio.to_thread(_ask, base, system, question)
            await asyncio.to_thread(pair.wait_metric, other, applied, lambda v: v >= target)
            return cached

        # Both gateways run the same policy with the same seed; requests that only B sees move its
        # random tie-breaks away from A's, so only sync can make B choose what A chose.
        for i in range(2):
            await ask(b, f"Warm-up {i} for gateway B only. " * 20, "hi")
        for i in range(5):
            system = f"Marmalade protocol {i}: answer in the voice of a lighthouse keeper. " * 12
            # New to every worker but the chat template's first block.
            assert await ask(a, system, "first") < 64
            # A's dispatch and its outcome have reached B: it now routes the prompt where A did.
            assert await ask(b, system, "second") >= 512
        done.set()
        await capturing

    asyncio.run(run())
    assert captured and not any(b"Marmalade" in data or b"lighthouse" in data for data in captured)


def _bursts_until(pair: Pair, done: Callable[[], bool], tag: str, long_prompts: int = 0) -> None:
    """Bursts of new prompts, 6 to each gateway at once (the first `long_prompts` of each 6 about
    15k tokens, a prefill the gateways predict at half a second), until `done()` after a burst; at
    most 40 bursts (480 requests; 1 to 3 usually do), each request answered 200."""
    a, b = pair.gateways

    async def burst(k: int) -> None:
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(headers=headers, timeout=60) as client:

            async def one(base: str, i: int) -> None:
                repeat = 1500 if i < long_prompts else 8
                system = f"Burst {tag} {k} prompt {i} to {base[-5:]}: an unrelated instruction. " * repeat
                body = {"model": "m", "messages": [{"role": "system", "content": system}], "max_tokens": 2}
                resp = await client.post(base + "/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text

            await asyncio.gather(*(one(base, i) for i in range(6) for base in (a, b)))

    for k in range(40):
        asyncio.run(burst(k))
        if done():
            return


def _either(pair: Pair, series: str) -> float:
    """The larger value of `series` at the two gateways."""
    return max(pair.metric(base, series) for base in pair.gateways)


def test_requests_reaching_both_gateways_at_once_part_over_their_home_shares(pair: Pair) -> None:
    """Bursts of new prompts sent to A and B together: each gateway sees the other's dispatches of
    the same instant only after they were made, measures that, and prefers its home share."""
    herd = 'kvgate_policy_events_total{event="herd_home_choices",policy="cost"}'
    unseen = "kvgate_sync_unseen_peer_dispatches"
    # The requests so far came one at a time: every decision saw the other gateway's earlier ones.
    assert _either(pair, herd) == 0
    assert _either(pair, unseen) < 0.5

    # A home choice is made while the unseen dispatches per decision are at least 0.5; the
    # decisions of the rest of that burst may bring the average back below it, so bursts go on
    # until the gauge shows it too.
    _bursts_until(pair, lambda: _either(pair, herd) > 0 and _either(pair, unseen) >= 0.5, "home")
    assert _either(pair, herd) > 0, pair.sync_state()
    assert _either(pair, unseen) >= 0.5, pair.sync_state()


def test_in_a_burst_long_prompts_are_held_and_every_request_is_served(pair: Pair) -> None:
    """Bursts mixing long new prompts with short ones, to A and B together: in a burst the
    gateways hold long ones before deciding them (`cost` step 5), and every request is served."""
    holds = 'kvgate_policy_events_total{event="herd_holds",policy="cost"}'
    _bursts_until(pair, lambda: _either(pair, holds) > 0, "held", long_prompts=2)
    assert _either(pair, holds) > 0


def test_with_the_broker_killed_both_gateways_keep_serving(pair: Pair) -> None:
    pair.broker.stop()
    for base in pair.gateways:
        pair.wait_metric(base, "kvgate_sync_connected", lambda v: v == 0)
        for i in range(3):
            _ask(base, f"Broker-free question {i} " * 30, "go")
        assert pair.metric(base, "kvgate_sync_queued_items") > 0  # waiting, bounded, not blocking


def test_when_the_broker_returns_both_gateways_share_again(pair: Pair) -> None:
    pair.broker.start()  # the same port
    for base in pair.gateways:
        pair.wait_metric(base, "kvgate_sync_connected", lambda v: v == 1, timeout_s=30)
        pair.wait_metric(base, "kvgate_sync_queued_items", lambda v: v == 0)  # what waited went out
    a, b = pair.gateways
    system = "Returning broker: answer as a ship's cook would. " * 12
    applied = 'kvgate_sync_events_total{event="applied_items"}'
    target = pair.metric(b, applied) + 2
    assert _ask(a, system, "first") < 64
    pair.wait_metric(b, applied, lambda v: v >= target)
    assert _ask(b, system, "second") >= 512
