"""CPU time of one request's gateway work, in process: the real ASGI entry point (head, tenant
slot, body, admission, normalizer, policy, answer, books) on the overhead bench's 64 chat bodies,
with the lean client's POST answered at once from memory, so no socket, event-loop wake-up or
worker is measured. Prints µs per request (process CPU time) for each repeat and their median.

    python -m tests.support.request_path_timing --policy cost --requests 5000 --repeats 5

Compare two trees by running it with each on `PYTHONPATH`, interleaved, on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

import orjson
import uvloop

from gateway.answer_budget import AnswerHold
from gateway.app import build_app
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.state import build_state
from gateway.upstream import UpstreamPool, UpstreamReply
from loadtest.overhead_load import chat_bodies
from policies import make_policy
from prompt_normalizer.normalizer import NormalizerConfig

SECRET = b"request-path-timing"
ANSWER = orjson.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
)


class InstantWorker(UpstreamPool):
    """The lean client with every POST answered from memory."""

    async def post(
        self,
        host: str,
        port: int,
        request: bytes,
        *,
        connect_s: float,
        read_s: float,
        total_s: float,
        hold: AnswerHold | None = None,
    ) -> UpstreamReply:
        return UpstreamReply(200, "application/json", ANSWER, ())


async def run(policy: str, requests: int, repeats: int) -> list[float]:
    config = parse_config(
        {
            "pools": [{"name": "bench", "models": ["static"], "workers": ["http://127.0.0.1:9"]}],
            "tenants": [{"name": "bench", "api_key_hashes": [hash_api_key(SECRET, "sk-bench")]}],
        }
    )
    state = build_state(config, SECRET, make_policy(policy), NormalizerConfig())
    app = build_app(state)
    state.transport.lean = InstantWorker()
    for pool in state.registry.pools.values():
        for worker in pool.workers.values():
            worker.healthy = True
    bodies = [b.encode() for b in chat_bodies(0, model="static")]
    heads = [
        [(b"authorization", b"Bearer sk-bench"), (b"content-length", str(len(b)).encode())] for b in bodies
    ]
    statuses: list[int] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def one(i: int) -> None:
        pending = [{"type": "http.request", "body": bodies[i % 64], "more_body": False}]

        async def receive() -> Any:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()  # never: the request has its whole body

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": heads[i % 64]}
        await app(scope, receive, send)

    for i in range(2000):  # warm-up: every body's prefix seen, caches filled
        await one(i)
    assert set(statuses) == {200}, statuses[:3]
    gc.freeze()
    gc.set_threshold(50_000)  # as `kvgate serve` runs
    out = []
    for _ in range(repeats):
        started = time.process_time()
        for i in range(requests):
            await one(i)
        out.append((time.process_time() - started) / requests * 1e6)
    assert set(statuses) == {200}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    us = uvloop.run(run(args.policy, args.requests, args.repeats))
    rounds = " ".join(f"{x:.1f}" for x in us)
    print(f"{args.policy}: {statistics.median(us):.1f} µs/request (median; rounds {rounds})")


if __name__ == "__main__":
    main()
