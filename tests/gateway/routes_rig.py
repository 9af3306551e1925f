"""A gateway in-process in front of two scripted workers (`routes_worker`), for the routes' tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies import make_policy
from policies.base import (
    Observation,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerView,
)
from tests.gateway.routes_worker import Received, RoutesWorker, start
from tests.support.inprocess import gateway_in_process
from tests.support.metrics import metric_total
from tests.support.policies import IgnoresFeedback

SECRET = b"routes"
KEY = {"authorization": "Bearer sk-t"}


class Recording(IgnoresFeedback):
    """round_robin, remembering what it was asked."""

    name = "recording"

    def __init__(self) -> None:
        self.inner: RoutingPolicy = make_policy("round_robin")
        self.requests: list[RouteRequest] = []
        self.observations: list[Observation] = []

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.requests.append(req)
        return self.inner.select(req, workers, now_s)

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self.inner.on_dispatch(req, decision, now_s)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.observations.append(obs)


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    policy: Recording
    workers: list[RoutesWorker] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)  # the workers' servers, in order

    def last(self) -> Received:
        got = [w.received[-1] for w in self.workers if w.received]
        assert got
        return max(got, key=lambda r: r.seq)

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.state, name, **labels)


def config(urls: list[str], pool: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": urls, "retry_attempts": 0, **(pool or {})}],
        "tenants": [
            {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]},
            {"name": "one", "api_key_hashes": [hash_api_key(SECRET, "sk-one")], "quotas": {"rpm": 1}},
            {"name": "other", "api_key_hashes": [hash_api_key(SECRET, "sk-other")]},
        ],
        "scrape": {"enabled": False},
        "limits": {"max_body_bytes": 4096},
        **extra,
    }


@contextlib.asynccontextmanager
async def routes_rig(pool: dict[str, Any] | None = None, **extra: Any) -> AsyncIterator[Rig]:
    """The gateway (round_robin, recorded) in front of workers w1 and w2; `pool` goes into its
    pool's config, `extra` into the gateway's."""
    workers = [RoutesWorker("w1"), RoutesWorker("w2")]
    runners = [await start(w) for w in workers]
    policy = Recording()
    try:
        built = config([w.url for w in workers], pool, **extra)
        async with gateway_in_process(built, policy, secret=SECRET) as gw:
            yield Rig(gw.client, gw.state, policy, workers, runners)
    finally:
        for runner in runners:
            await runner.cleanup()
