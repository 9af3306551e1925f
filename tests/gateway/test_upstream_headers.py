"""Worker credentials and forwarded client headers: config rules, key sources, and what reaches
a worker on every kind of request (completions by both transports, health checks, scrapes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway.app import build_app
from gateway.auth import hash_api_key
from gateway.config import load_config, parse_config
from gateway.config.base import ConfigError
from gateway.config.pool import read_worker_key
from gateway.state import GatewayState, build_state
from gateway.streaming import AiohttpSource
from gateway.upstream import AnswerBudget
from gateway.upstream_headers import NO_AUTH, WorkerAuth, forwardable_name, pick
from policies import make_policy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.inprocess import every_worker_up
from tests.support.loopback import serve_app

SECRET = b"k"
KEY = "sk-worker-7f3a"


def _pool(**extra: Any) -> dict[str, Any]:
    return {"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"], **extra}


def _config(**pool: Any) -> dict[str, Any]:
    return {
        "pools": [_pool(**pool)],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
    }


def test_while_tracing_a_clients_trace_context_is_not_forwarded() -> None:
    """The attempt's own CLIENT span context goes to the worker; forwarding the client's too would
    send the worker two `traceparent` headers."""
    raw = _config(forward_headers=["x-b", "traceparent", "tracestate"])
    quiet = build_state(parse_config(raw), SECRET, make_policy("round_robin"), NormalizerConfig())
    assert quiet.registry.pools["p"].forward == {b"x-b", b"traceparent", b"tracestate"}
    traced_config = parse_config({**raw, "tracing": {"enabled": True}})
    traced = build_state(traced_config, SECRET, make_policy("round_robin"), NormalizerConfig())
    assert traced.registry.pools["p"].forward == {b"x-b"}


def test_header_names_are_lower_cased_and_dangerous_ones_refused() -> None:
    assert forwardable_name(" X-Trace-Tag ") == "x-trace-tag"
    for name in (
        "Authorization",
        "x-api-key",
        "Connection",
        "transfer-encoding",
        "host",
        "cookie",
        "x-request-id",
    ):
        with pytest.raises(ValueError, match="can never be forwarded"):
            forwardable_name(name)
    with pytest.raises(ValueError, match="not a header name"):
        forwardable_name("x trace")


def test_the_config_names_the_field_of_a_forbidden_header() -> None:
    with pytest.raises(
        ConfigError, match=r"pools\.0\.forward_headers.*'authorization' can never be forwarded"
    ):
        parse_config(_config(forward_headers=["traceparent", "Authorization"]))
    cfg = parse_config(_config(forward_headers=["Traceparent", "x-b", "traceparent"]))
    assert cfg.pools[0].forward_headers == ["traceparent", "x-b"]
    with pytest.raises(ConfigError, match="not both"):
        parse_config(_config(worker_api_key_env="A", worker_api_key_file="/f"))


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("X-data-parallel-rank", "engine-internal header: vLLM reads it as .* data_parallel_rank"),
        ("Forwarded", "a proxy header"),
        ("X-Forwarded-For", "a proxy header"),
        ("x-forwarded-host", "a proxy header"),
        ("X-Forwarded-Proto", "a proxy header"),
        ("x-real-ip", "a proxy header"),
    ],
)
def test_engine_and_proxy_headers_are_refused_naming_the_header_and_why(name: str, reason: str) -> None:
    """vLLM reads `X-data-parallel-rank` as `data_parallel_rank` (refused in a body); a worker may
    believe a client's `Forwarded` or `X-Forwarded-*` as a proxy's."""
    lowered = name.lower()
    with pytest.raises(ValueError, match=f"'{lowered}' can never be forwarded .*{reason}"):
        forwardable_name(name)
    with pytest.raises(ConfigError, match=rf"pools\.0\.forward_headers.*'{lowered}' can never be forwarded"):
        parse_config(_config(forward_headers=["traceparent", name]))
    # Names that only look alike are a pool's to choose.
    assert forwardable_name("x-my-" + lowered) == "x-my-" + lowered


def test_the_key_comes_from_the_file_or_the_variable_and_errors_never_quote_it(tmp_path: Path) -> None:
    pool = parse_config(_config(worker_api_key_env="WORKER_KEY")).pools[0]
    assert read_worker_key(pool, {"WORKER_KEY": KEY}) == KEY
    with pytest.raises(
        ConfigError, match=r"pools\.p\.worker_api_key_env: environment variable WORKER_KEY is not set"
    ):
        read_worker_key(pool, {})
    with pytest.raises(ConfigError, match="printable ASCII") as info:
        read_worker_key(pool, {"WORKER_KEY": KEY + "\n" + KEY})
    assert KEY not in str(info.value)
    key_file = tmp_path / "worker-key"
    key_file.write_text(KEY + "\n")
    pool = parse_config(_config(worker_api_key_file=str(key_file))).pools[0]
    assert read_worker_key(pool, {}) == KEY
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_worker_key(pool, {})
    assert read_worker_key(parse_config(_config()).pools[0], {"WORKER_KEY": KEY}) is None


def test_a_relative_key_file_is_read_beside_the_config(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "p").write_text(KEY)
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pools: [{name: p, models: [m], workers: ['http://127.0.0.1:9'], worker_api_key_file: keys/p}]\n"
        f"tenants: [{{name: t, api_key_hashes: ['{hash_api_key(SECRET, 'sk')}']}}]\n"
    )
    assert read_worker_key(load_config(path).pools[0], {}) == KEY


def test_a_missing_key_stops_the_state_from_being_built() -> None:
    config = parse_config(_config(worker_api_key_env="WORKER_KEY"))
    with pytest.raises(ConfigError, match="WORKER_KEY is not set"):
        build_state(config, SECRET, make_policy("round_robin"), NormalizerConfig(), environ={})


def test_the_key_is_never_in_a_repr() -> None:
    auth = WorkerAuth(KEY)
    assert KEY not in repr(auth) and repr(NO_AUTH) == "WorkerAuth(none)"
    assert auth.headers == {"Authorization": f"Bearer {KEY}"}
    assert pick([(b"a", b"1"), (b"b", b"2"), (b"a", b"3")], frozenset({b"a"})) == ((b"a", b"1"), (b"a", b"3"))


@dataclass
class Seen:
    completions: list[dict[str, str]] = field(default_factory=list)  # headers of each POST
    others: list[tuple[str, str | None]] = field(default_factory=list)  # (path, authorization)


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    seen: Seen


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    seen = Seen()

    async def health(request: web.Request) -> web.Response:
        seen.others.append((request.path, request.headers.get("authorization")))
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.completions.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        if not body.get("stream"):
            return web.json_response({"choices": [], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    worker = web.Application()
    worker.router.add_get("/health", health)
    worker.router.add_get("/metrics", health)
    worker.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(worker)
    url = f"http://127.0.0.1:{port}"
    raw = _config(
        workers=[url], worker_api_key_env="WORKER_KEY", forward_headers=["x-trace-tag", "traceparent"]
    )
    raw["scrape"] = {"interval_s": 0.05}
    state = build_state(
        parse_config(raw), SECRET, make_policy("round_robin"), NormalizerConfig(), environ={"WORKER_KEY": KEY}
    )
    app = build_app(state)
    try:
        async with (
            app.fallback.router.lifespan_context(app.fallback),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
        ):
            await every_worker_up(state)
            yield Rig(client, state, seen)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("transport", ["lean", "aiohttp"])
@pytest.mark.parametrize("stream", [False, True])
async def test_completions_carry_the_pool_key_and_only_the_allowed_client_headers(
    rig: Rig, transport: str, stream: bool
) -> None:
    if transport == "aiohttp":  # what https workers use
        for worker in rig.state.registry.pools["p"].workers.values():
            worker.direct = None
    client_headers = {
        "authorization": "Bearer sk",  # the client's key: the gateway's business only
        "x-api-key": "sk",
        "X-Trace-Tag": "run-42",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-not-listed": "private",
        "cookie": "session=1",
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    resp = await rig.client.post("/v1/chat/completions", json=body, headers=client_headers)
    assert resp.status_code == 200
    (got,) = rig.seen.completions
    assert got["authorization"] == f"Bearer {KEY}"
    assert got["x-trace-tag"] == "run-42" and got["traceparent"].startswith("00-0af7")
    assert not {"x-api-key", "x-not-listed", "cookie"} & set(got)
    assert got["x-request-id"] != "" and got["content-type"] == "application/json"


async def test_health_checks_and_scrapes_carry_the_pool_key(rig: Rig) -> None:
    deadline = time.monotonic() + 5
    while {path for path, _ in rig.seen.others} != {"/health", "/metrics"}:
        assert time.monotonic() < deadline, rig.seen.others
        await asyncio.sleep(0.01)
    assert {auth for _, auth in rig.seen.others} == {f"Bearer {KEY}"}


async def test_a_worker_hint_that_is_not_latin_1_is_dropped_not_a_crash() -> None:
    """aiohttp decodes answer headers as UTF-8: a busy worker's `Retry-After: 5 \u20ac` cannot be
    passed on, and is dropped (the client gets the gateway's own advice) rather than failing the
    request with a 500; the worker's other hints are kept."""

    async def busy(_: web.Request) -> web.Response:
        hints = {"Retry-After": "5 \u20ac", "Retry-After-Ms": "300"}
        return web.json_response({"error": {"message": "busy"}}, status=503, headers=hints)

    app = web.Application()
    app.router.add_get("/r", busy)
    runner, port = await serve_app(app)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/r") as resp:
            source = AiohttpSource(resp, AnswerBudget(1024))
    finally:
        await runner.cleanup()
    assert (source.status, source.retry_hints) == (503, ((b"retry-after-ms", b"300"),))
