"""In-process request path against a scripted upstream: salts, request ids, policy outcomes."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.app import GatewayApp
from gateway.auth import hash_api_key
from gateway.disconnect import DisconnectWatch
from gateway.state import GatewayState
from policies.base import (
    Observation,
    Outcome,
    RouteDecision,
    RouteRequest,
    WorkerView,
    prefill_pairs,
)
from prompt_normalizer.types import PUBLIC_NAMESPACE
from tests.prompt_normalizer.tiny_model import build_tiny_model
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.policies import IgnoresFeedback
from tests.support.wait import wait_until

SECRET = b"k"


@dataclass
class ScriptedPolicy(IgnoresFeedback):
    """Picks the first healthy worker and claims `shared_blocks` public blocks; records feedback."""

    name: str = "scripted"
    shared_blocks: int = 0
    requests: list[RouteRequest] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.requests.append(req)
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        return RouteDecision(healthy[0].worker_id, 0.0, "first", shared_prefix_blocks=self.shared_blocks)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self.observations.append(obs)


@dataclass
class Upstream:
    status: int = 200
    error_body: Any = None
    received: list[dict[str, Any]] = field(default_factory=list)
    peers: set[Any] = field(default_factory=set)  # the gateway's end of each connection used
    # Streams: the pause between chunks, and after [DONE] before the body ends.
    chunk_pause_s: float = 0.0
    tail_pause_s: float = 0.0
    garbage: bytes | None = None  # answer 200 with this instead of a completion (or its chunks)
    gate: asyncio.Event | None = None  # streams wait for it before their first chunk


@dataclass
class Rig:
    client: httpx.AsyncClient
    upstream: Upstream
    policy: ScriptedPolicy
    state: GatewayState
    app: GatewayApp

    async def chat(self, key: str = "sk-strict", **extra: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}", **extra.pop("headers", {})}
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    upstream = Upstream()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        upstream.received.append({"request_id": request.headers.get("x-request-id"), "body": body})
        if request.transport is not None:
            upstream.peers.add(request.transport.get_extra_info("peername"))
        if upstream.status != 200:
            if isinstance(upstream.error_body, bytes):
                return web.Response(body=upstream.error_body, status=upstream.status)
            error = upstream.error_body if upstream.error_body is not None else {"error": {"message": "no"}}
            return web.json_response(error, status=upstream.status)
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            if upstream.garbage is not None:
                return web.Response(body=upstream.garbage, content_type="application/json")
            return web.json_response({"choices": [], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if upstream.garbage is not None:
            await resp.write(b"data: " + upstream.garbage + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if upstream.gate is not None:
            await upstream.gate.wait()
        for word in ("a", "b", "c"):
            delta = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
            await resp.write(b"data: " + orjson.dumps(delta) + b"\n\n")
            await asyncio.sleep(upstream.chunk_pause_s)
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(upstream.tail_pause_s)
        await resp.write_eof()
        return resp

    server = web.Application()
    server.router.add_get("/health", health)
    server.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(server)

    def tenant(name: str, isolation: str) -> dict[str, Any]:
        return {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")], "isolation": isolation}

    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m", "m-lora"],
                "adapters": {"m-lora": "sql-lora"},
                "workers": [f"http://127.0.0.1:{port}"],
                "retry_attempts": 0,
                "identity": {"weights_version": "w1", "epoch": 3},
            },
            {
                "name": "tok",
                "models": ["m-tok"],
                "workers": [f"http://127.0.0.1:{port}"],
                "normalizer": {"mode": "tokenizer", "tokenizer_dir": str(tiny_model)},
            },
        ],
        "tenants": [
            tenant("strict", "strict"),
            tenant("shared", "shared_public"),
            tenant("pub", "public"),
        ],
        "scrape": {"enabled": False},
    }
    policy = ScriptedPolicy()
    try:
        async with gateway_in_process(config, policy, secret=SECRET) as gw:
            yield Rig(gw.client, upstream, policy, gw.state, gw.app)
    finally:
        await runner.cleanup()


async def test_every_request_is_salted_and_a_client_salt_is_replaced(rig: Rig) -> None:
    salts = {}
    for name in ("strict", "shared", "pub"):
        resp = await rig.chat(f"sk-{name}", cache_salt="mine")
        assert resp.status_code == 200
        salts[name] = rig.upstream.received[-1]["body"]["cache_salt"]
    assert len(set(salts.values())) == 3 and "mine" not in salts.values()
    assert salts["strict"] == rig.state.gate.keyring.tenants["strict"].cache_salt
    # Every tenant's own keys live in its own namespace (its KV is salted with its own salt).
    assert [r.namespace for r in rig.policy.requests] == ["tenant:strict", "tenant:shared", "tenant:pub"]


async def test_public_salt_only_when_the_whole_prompt_is_in_promoted_blocks(rig: Rig) -> None:
    system = {"role": "system", "content": "S" * 400}  # 100 approximate tokens: 6 full blocks
    rig.policy.shared_blocks = 6
    public_salt = rig.state.gate.keyring.public_salt
    # A prompt with a private tail after the promoted prefix keeps the tenant's salt.
    resp = await rig.chat("sk-shared", messages=[system, {"role": "user", "content": "a private question"}])
    assert resp.status_code == 200
    req = rig.policy.requests[-1]
    assert req.public_block_keys and req.n_prompt_tokens > 6 * req.block_size_tokens
    assert (
        rig.upstream.received[-1]["body"]["cache_salt"] == rig.state.gate.keyring.tenants["shared"].cache_salt
    )
    # A policy claiming more shared blocks than the request has is not trusted.
    rig.policy.shared_blocks = 10_000
    resp = await rig.chat("sk-shared", messages=[system])
    assert rig.upstream.received[-1]["body"]["cache_salt"] != public_salt
    # Never for a strict tenant (the rule itself: tests/policies/test_identity.py).
    resp = await rig.chat("sk-strict", messages=[system])
    assert (
        rig.upstream.received[-1]["body"]["cache_salt"] == rig.state.gate.keyring.tenants["strict"].cache_salt
    )
    assert rig.state.gate.keyring.salt_namespaces[public_salt] == PUBLIC_NAMESPACE


async def test_internal_request_id_is_sent_upstream_and_the_client_id_only_echoed(rig: Rig) -> None:
    ids = []
    for _ in range(2):
        resp = await rig.chat(headers={"x-request-id": "same-client-id"})
        assert resp.headers["x-request-id"] == "same-client-id"
        ids.append(rig.upstream.received[-1]["request_id"])
    assert len(set(ids)) == 2 and "same-client-id" not in ids
    assert [r.request_id for r in rig.policy.requests] == ids


def _through(rig: Rig, transport: str) -> None:
    """Send the rig's requests through `transport`: the lean client (http:// workers, the
    default) or aiohttp (what https workers use)."""
    if transport == "aiohttp":
        for pool in rig.state.registry.pools.values():
            for worker in pool.workers.values():
                worker.direct = None


TRANSPORTS = ["lean", "aiohttp"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("status", "outcome", "client_status"),
    [(200, Outcome.SERVED, 200), (400, Outcome.REJECTED, 400), (500, Outcome.WORKER_FAILED, 502)],
)
async def test_policy_learns_the_outcome(
    rig: Rig, status: int, outcome: Outcome, client_status: int, transport: str
) -> None:
    _through(rig, transport)
    rig.upstream.status = status
    resp = await rig.chat()
    assert resp.status_code == client_status
    (obs,) = rig.policy.observations
    assert obs.outcome is outcome and obs.failed == (outcome is not Outcome.SERVED)
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    # A 4xx says nothing about the worker's health; a 5xx counts against its breaker.
    assert worker.breaker.failures == (1 if outcome is Outcome.WORKER_FAILED else 0)


@pytest.mark.parametrize(
    ("status", "worker_body", "expected"),
    [
        (  # vLLM today: nested, with a class name for type and the status as an integer code
            400,
            {
                "error": {
                    "message": "max_tokens is too large",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
            {
                "message": "max_tokens is too large",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            },
        ),
        (  # older vLLM: the fields at the top level
            404,
            {
                "object": "error",
                "message": "The model `x` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
            {
                "message": "The model `x` does not exist.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
        (
            429,
            {"error": {"message": "slow down", "type": "RateLimitError", "code": "too_many"}},
            {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "too_many"},
        ),
        (
            422,
            b"<html>not json</html>",
            {
                "message": "the worker refused the request (HTTP 422)",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
    ],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_worker_errors_are_passed_through_in_the_gateway_shape(
    rig: Rig, status: int, worker_body: Any, expected: dict[str, Any], transport: str
) -> None:
    _through(rig, transport)
    rig.upstream.status = status
    rig.upstream.error_body = worker_body
    for stream in (False, True):
        resp = await rig.chat(stream=stream)
        assert resp.status_code == status
        assert resp.headers["content-type"].startswith("application/json")
        assert orjson.loads(resp.content) == {"error": expected}


async def test_engine_internal_fields_are_refused(rig: Rig) -> None:
    for name in ("kv_transfer_params", "rid", "data_parallel_rank", "prompt_embeds"):
        resp = await rig.chat(**{name: 1})
        assert resp.status_code == 400
        error = orjson.loads(resp.content)["error"]
        assert error["param"] == name and name in error["message"]
    assert rig.upstream.received == []


async def test_identity_fields_and_adapter_are_bound_into_the_keys(rig: Rig) -> None:
    pool = rig.state.registry.pools["p"]
    tenant = rig.state.gate.keyring.tenants["shared"]
    own, public = rig.state.gate.keying.identities(pool, "m", tenant)
    assert (own.weights_version, own.epoch, own.namespace, own.adapter) == ("w1", 3, "tenant:shared", "")
    assert public is not None and public == own.__class__(**{**_fields(own), "namespace": PUBLIC_NAMESPACE})
    lora, _ = rig.state.gate.keying.identities(pool, "m-lora", tenant)
    assert (lora.model_id, lora.adapter) == ("m", "sql-lora")
    strict_own, strict_public = rig.state.gate.keying.identities(
        pool, "m", rig.state.gate.keyring.tenants["strict"]
    )
    assert strict_public is None and strict_own.namespace == "tenant:strict"
    await rig.chat(model="m-lora")
    assert rig.policy.requests[-1].adapter == "sql-lora"
    a = await rig.chat(messages=[{"role": "system", "content": "S" * 200}])
    b = await rig.chat(model="m-lora", messages=[{"role": "system", "content": "S" * 200}])
    assert a.status_code == b.status_code == 200
    assert not set(rig.policy.requests[-1].block_keys) & set(rig.policy.requests[-2].block_keys)


async def test_a_session_key_reaches_the_policy_scoped_by_tenant(rig: Rig) -> None:
    for name in ("strict", "shared"):
        assert (await rig.chat(f"sk-{name}", prompt_cache_key="conv-1")).status_code == 200
    assert [r.session_key for r in rig.policy.requests] == ["tenant:strict/conv-1", "tenant:shared/conv-1"]
    await rig.chat(prompt_cache_key=7)  # not a string: no session
    assert rig.policy.requests[-1].session_key is None


def _fields(identity: Any) -> dict[str, Any]:
    return {name: getattr(identity, name) for name in identity.__dataclass_fields__}


async def test_tokenizer_mode_runs_off_the_event_loop(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    normalizer = rig.state.gate.keying.normalizers["tok"]
    real = normalizer.canonicalize
    threads: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(normalizer, "canonicalize", recording)
    for _ in range(2):
        resp = await rig.chat(model="m-tok", messages=[{"role": "user", "content": "hello there " * 500}])
        assert resp.status_code == 200
    assert len(threads) == 2 and all(t.startswith("kvgate-normalizer") for t in threads)
    assert rig.policy.requests[-1].n_prompt_tokens > 500


@dataclass
class HoldingPolicy(ScriptedPolicy):
    """Asks for every request to be held `hold` seconds first (`policies.peer_sync.SupportsHold`),
    and records when it was asked and when it decided."""

    hold: float = 0.05
    asked_s: list[float] = field(default_factory=list)
    decided_s: list[float] = field(default_factory=list)

    def hold_s(self, req: RouteRequest, now_s: float) -> float:
        self.asked_s.append(now_s)
        return self.hold

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.decided_s.append(now_s)
        return super().select(req, workers, now_s)


async def test_a_request_the_policy_holds_is_decided_after_the_hold_and_served(rig: Rig) -> None:
    policy = HoldingPolicy()
    rig.state.routing.policy = policy  # as a reload swaps it
    resp = await rig.chat()
    assert resp.status_code == 200
    (asked,), (decided,) = policy.asked_s, policy.decided_s
    assert decided - asked >= 0.9 * policy.hold  # the sleep's clock may round a little early
    policy.hold = 0.0
    assert (await rig.chat()).status_code == 200
    assert len(policy.asked_s) == len(policy.decided_s) == 2
    assert rig.state.routing.hold_s(policy.requests[-1], 0.0) == 0.0
    rig.state.routing.policy = rig.policy  # a policy without `hold_s` is never held
    assert rig.state.routing.hold_s(policy.requests[-1], 0.0) == 0.0
    assert (await rig.chat()).status_code == 200


@dataclass
class MatchingPolicy(ScriptedPolicy):
    """Predicts `matched` cached tokens on the worker it picks."""

    matched: int = 0

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        decision = super().select(req, workers, now_s)
        if decision is None:
            return None
        return dataclasses.replace(decision, matched_tokens=min(self.matched, req.n_prompt_tokens))


async def test_a_pending_prompts_attention_is_counted_with_its_predicted_match_until_its_first_token(
    rig: Rig,
) -> None:
    policy = MatchingPolicy(matched=2)
    rig.state.routing.policy = policy
    rig.upstream.gate = asyncio.Event()
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    pending = asyncio.create_task(rig.chat(stream=True))
    pairs = await wait_until(lambda: worker.prefill_pairs, what="the prompt is pending on the worker")
    (r,) = policy.requests
    assert r.n_prompt_tokens > 2 and pairs == prefill_pairs(r.n_prompt_tokens, 2)
    assert worker.view(0.0).in_flight_prefill_pairs == pairs
    rig.upstream.gate.set()
    assert (await pending).status_code == 200
    assert worker.prefill_pairs == 0 and worker.prefill_tokens == 0 and worker.in_flight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stream_that_reached_done_is_a_success_whatever_the_socket_does_next(
    rig: Rig, transport: str
) -> None:
    _through(rig, transport)
    # The disconnect watcher runs from 20 ms on, and the worker ends its body 50 ms after [DONE]:
    # the client's response is complete by then, which its receive() reports as a disconnect.
    rig.state.lifecycle.disconnects = DisconnectWatch(delay_s=0.02)
    rig.upstream.chunk_pause_s = 0.03
    rig.upstream.tail_pause_s = 0.05
    streams = 5
    for _ in range(streams):
        resp = await rig.chat(stream=True)
        assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
    assert [obs.outcome for obs in rig.policy.observations] == [Outcome.SERVED] * streams
    statuses = {values[2] for values in rig.state.routing.metrics.requests.children}
    assert statuses == {"200"}
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 0 and worker.in_flight == 0
    # Read to its end, each connection went back to the pool (closing it would take one per
    # stream). The lean client reuses the one it has; aiohttp's pool hands out its oldest idle
    # connection first, some of them opened by health checks.
    if transport == "lean":
        assert len(rig.upstream.peers) == 1
    else:
        assert len(rig.upstream.peers) < streams


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_answer_is_a_502_and_counts_against_the_worker(
    rig: Rig, transport: str, stream: bool
) -> None:
    _through(rig, transport)
    rig.upstream.garbage = b"<html>502 from a proxy in front of the worker</html>"
    resp = await rig.chat(stream=stream)
    assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
    error = orjson.loads(resp.content)["error"]
    assert (error["type"], error["code"]) == ("server_error", "bad_gateway")
    assert error["message"].startswith("worker sent a malformed")
    (obs,) = rig.policy.observations
    assert obs.outcome is Outcome.WORKER_FAILED
    worker = next(iter(rig.state.registry.pools["p"].workers.values()))
    assert worker.breaker.failures == 1 and worker.in_flight == 0
