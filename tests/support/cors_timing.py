"""CPU time of one chat request's gateway work with CORS off, on for a request without `Origin`,
and on for a request from an allowed origin: the three apps in one process, measured in turns
(as `request_path_timing` measures one: the real ASGI entry point, the worker's answer from
memory). Prints µs per request (process CPU time), the median of the repeats, for each.

    python -m tests.support.cors_timing --requests 4000 --repeats 9
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

import uvloop

from gateway.app import GatewayApp, build_app
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.state import build_state
from loadtest.overhead_load import chat_bodies
from policies import make_policy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.request_path_timing import SECRET, InstantWorker

ORIGIN = b"https://app.example"
Head = list[tuple[bytes, bytes]]


def _app(cors: bool) -> GatewayApp:
    config = parse_config(
        {
            "pools": [{"name": "bench", "models": ["static"], "workers": ["http://127.0.0.1:9"]}],
            "tenants": [{"name": "bench", "api_key_hashes": [hash_api_key(SECRET, "sk-bench")]}],
            "cors": {"allow_origins": [ORIGIN.decode(), "https://other.example"] if cors else []},
        }
    )
    state = build_state(config, SECRET, make_policy("cost"), NormalizerConfig())
    app = build_app(state)
    state.transport.lean = InstantWorker()
    for pool in state.registry.pools.values():
        for worker in pool.workers.values():
            worker.healthy = True
    return app


async def run(requests: int, repeats: int) -> dict[str, list[float]]:
    bodies = [b.encode() for b in chat_bodies(0, model="static")]

    def heads(origin: bool) -> list[Head]:
        extra = [(b"origin", ORIGIN)] if origin else []
        return [
            [(b"authorization", b"Bearer sk-bench"), (b"content-length", str(len(b)).encode()), *extra]
            for b in bodies
        ]

    # CORS off with the Origin header sent: the same request bytes as the last variant.
    variants = {
        "off": (_app(False), heads(True)),
        "on, no Origin": (_app(True), heads(False)),
        "on, allowed Origin": (_app(True), heads(True)),
    }
    statuses: list[int] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def one(app: GatewayApp, head: Head, i: int) -> None:
        pending = [{"type": "http.request", "body": bodies[i % 64], "more_body": False}]

        async def receive() -> Any:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()  # never: the request has its whole body

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": head}
        await app(scope, receive, send)

    for app, hs in variants.values():
        for i in range(2000):  # warm-up: every body's prefix seen, caches filled
            await one(app, hs[i % 64], i)
    assert set(statuses) == {200}, statuses[:3]
    gc.freeze()
    gc.set_threshold(50_000)  # as `kvgate serve` runs
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (app, hs) in variants.items():
            started = time.process_time()
            for i in range(requests):
                await one(app, hs[i % 64], i)
            out[name].append((time.process_time() - started) / requests * 1e6)
    assert set(statuses) == {200}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    for name, us in uvloop.run(run(args.requests, args.repeats)).items():
        rounds = " ".join(f"{x:.1f}" for x in us)
        print(f"{name}: {statistics.median(us):.1f} µs/request (median; rounds {rounds})")


if __name__ == "__main__":
    main()
