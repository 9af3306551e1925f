"""Hostile clients: what a client controls before it is admitted (header bytes, the time to send
headers and body), requests that once made the gateway fail (deep JSON, a prompt estimated at
zero tokens, a trailing slash), what the client port must not answer, and an operator regex that
backtracks."""

from __future__ import annotations

import asyncio
import time

import orjson
import yaml

from loadtest.abuse.client import CHAT, chat_body, post, text
from loadtest.abuse.observe import RssPeak, admin_status, metrics, series, wait_for
from loadtest.abuse.probe import Context, Observation, Probe
from loadtest.abuse.report import counts, mib
from loadtest.abuse.settings import Sizes
from loadtest.abuse.stack import KEY_A, KEY_ADMIN, KEY_B, MODEL, TENANT_A_CONCURRENCY, policy_document
from loadtest.client_probes import Target, partial_bodies, slow_headers, unfinished_headers

RSS_BOUND = 150 * 1024 * 1024
CLOSE_BOUND_S = 30.0
DEEP = 300


def _target(ctx: Context) -> Target:
    return Target("127.0.0.1", ctx.stack.port)


async def _unfinished_headers(ctx: Context) -> Observation:
    n = ctx.sizes.header_connections
    async with RssPeak(ctx.stack.gateway_pid, interval_s=0.02) as rss:
        results = await unfinished_headers(
            _target(ctx), connections=n, header_bytes=ctx.sizes.header_bytes, timeout_s=CLOSE_BOUND_S + 5
        )
    closed = [r.closed_after_s for r in results if r.closed_after_s is not None]
    slowest = max(closed, default=float("inf"))
    sent = max(r.sent_bytes for r in results)
    ok = rss.growth < RSS_BOUND and len(closed) == n and slowest <= CLOSE_BOUND_S
    return Observation(
        f"RSS +{mib(rss.growth)} (from {mib(rss.start)}); {len(closed)}/{n} closed, slowest "
        f"{slowest:.1f} s; status {counts([r.status or 'none' for r in results])}; at most "
        f"{mib(sent)} sent",
        ok,
    )


async def _slowloris(ctx: Context) -> Observation:
    n = ctx.sizes.slow_connections
    results = await slow_headers(_target(ctx), connections=n, interval_s=1.0, timeout_s=CLOSE_BOUND_S + 5)
    closed = [r.closed_after_s for r in results if r.closed_after_s is not None]
    slowest = max(closed, default=float("inf"))
    return Observation(
        f"{len(closed)}/{n} closed, slowest {slowest:.1f} s; status {counts([r.status for r in results])}",
        len(closed) == n and slowest <= CLOSE_BOUND_S,
    )


async def _refused_429(ctx: Context) -> float:
    samples = await metrics(ctx.session, ctx.stack)
    return series(samples, "kvgate_requests_total", endpoint="chat", model="", status="429")


async def _partial_bodies(ctx: Context) -> Observation:
    n, m = ctx.sizes.partial_connections, ctx.sizes.other_tenant_requests
    before = await _refused_429(ctx)
    started = asyncio.Event()
    held = asyncio.create_task(
        partial_bodies(
            _target(ctx),
            connections=n,
            api_key=KEY_A,
            model=MODEL,
            timeout_s=ctx.sizes.body_timeout_s + 20,
            started=started,
        )
    )
    await asyncio.wait_for(started.wait(), 20)

    # Every head was read: those beyond A's own slots were refused at once.
    async def heads_seen() -> bool:
        return await _refused_429(ctx) >= before + n - TENANT_A_CONCURRENCY

    await wait_for(heads_seen, 10, 0.05)
    gate = asyncio.Semaphore(8)

    async def one(i: int) -> int:
        async with gate:
            body = chat_body(text(f"{ctx.run_id}/partial/{i}", 200), 8)
            return (await post(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=20)).status

    b_started = time.monotonic()
    b_statuses = await asyncio.gather(*(one(i) for i in range(m)))
    b_s = time.monotonic() - b_started
    a_still_held = not held.done()
    results = await held
    closed = [r.closed_after_s for r in results if r.closed_after_s is not None]
    a_statuses = [r.status for r in results]
    served = sum(s == 200 for s in b_statuses)
    ok = (
        served == m
        and a_still_held
        and len(closed) == n
        and sum(s not in (429, None) for s in a_statuses) <= TENANT_A_CONCURRENCY
    )
    return Observation(
        f"B {served}/{m} → 200 in {b_s:.1f} s while A's bodies were pending"
        f"{'' if a_still_held else ' (A no longer held)'}; A: status {counts(a_statuses)}, "
        f"{len(closed)}/{n} closed by the server (slowest {max(closed, default=0):.1f} s)",
        ok,
    )


async def _deep_json(ctx: Context) -> Observation:
    body = orjson.dumps(chat_body("x", 4))[:-1] + b',"x":' + b"[" * DEEP + b"]" * DEEP + b"}"
    reply = await post(ctx.session, ctx.url(CHAT), KEY_B, body)
    return Observation(f"{reply.status} {reply.error_code}", reply.status == 400)


async def _tiny_prompt(ctx: Context) -> Observation:
    before = ctx.log.tracebacks()
    rid = ctx.rid("hi")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    reply = await post(ctx.session, ctx.url("/v1/completions"), KEY_B, body, request_id=rid)
    logged = await ctx.log.wait_requests({rid})
    new = ctx.log.tracebacks() - before
    return Observation(
        f"{reply.status}; access line {'written' if logged else 'missing'}; {new} new tracebacks in the log",
        reply.status == 200 and bool(logged) and new == 0,
    )


async def _trailing_slash(ctx: Context) -> Observation:
    body = orjson.dumps(chat_body("x", 4))
    headers = {"authorization": f"Bearer {KEY_B}", "content-type": "application/json", "host": "evil.example"}
    async with ctx.session.post(
        ctx.url(CHAT + "/"), data=body, headers=headers, allow_redirects=False
    ) as resp:
        location = resp.headers.get("location")
        status = resp.status
    return Observation(
        f"{status}{f', Location: {location}' if location else ', no Location'}",
        status == 404 and location is None,
    )


async def _metrics_port(ctx: Context) -> Observation:
    async with ctx.session.get(ctx.url("/metrics")) as resp:
        client_status = resp.status
        client_body = await resp.text()
    async with ctx.session.get(ctx.stack.metrics_url) as resp:
        own_status = resp.status
        own_has = "kvgate_requests_total" in await resp.text()
    ok = client_status == 404 and "tenant" not in client_body and own_status == 200 and own_has
    return Observation(f"client port {client_status}; metrics port {own_status}", ok)


async def _reload(ctx: Context) -> tuple[int, str]:
    headers = {"authorization": f"Bearer {KEY_ADMIN}"}
    async with ctx.session.post(ctx.url("/admin/policy/reload"), headers=headers) as resp:
        raw = await resp.read()
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return resp.status, raw[:200].decode(errors="replace")
    error = doc.get("error") if isinstance(doc, dict) else None
    return resp.status, str(error.get("message") if isinstance(error, dict) else doc)


async def _regex(ctx: Context) -> Observation:
    # The running rule is `Session: (\w+\s?)+;`; a text with no `;` makes Python's `re` try every
    # way to split the words between groups (1.4 s at 34 characters, x4 per 2 more).
    words = "abcd " * 400

    async def timed(prefix: str, i: int) -> tuple[int, float]:
        body = chat_body(f"{prefix}{words}{i}", 4)
        reply = await post(ctx.session, ctx.url(CHAT), KEY_B, body, timeout_s=60)
        return reply.status, reply.elapsed_s

    baseline = [await timed("Topic: ", i) for i in range(3)]
    hostile = [await timed("Session: ", i) for i in range(3)]
    worst, base = max(t for _, t in hostile), max(t for _, t in baseline)
    linear = all(s == 200 for s, _ in hostile + baseline) and worst < 2.0
    # A pattern RE2 cannot run in linear time is refused when the policy is loaded.
    good = ctx.stack.policy_path.read_text()
    ctx.stack.policy_path.write_text(yaml.safe_dump(policy_document(r"Session: (\w+)\1;"), sort_keys=False))
    try:
        refused_status, refused_msg = await _reload(ctx)
    finally:
        ctx.stack.policy_path.write_text(good)
    restored_status, _ = await _reload(ctx)
    policy = (await admin_status(ctx.session, ctx.stack)).get("policy", {})
    refused = refused_status == 422 and "backreference" in refused_msg
    refused_msg = refused_msg[refused_msg.find("pattern refused") :] if refused else refused_msg
    return Observation(
        f"{len(words) + 10}-char 'Session:' text without ';': slowest {worst * 1000:.0f} ms "
        f"(plain text {base * 1000:.0f} ms); backreference rule: reload {refused_status} "
        f"'{refused_msg[:90]}'; restored {restored_status}, running {policy.get('name')}",
        linear and refused and restored_status == 200,
    )


def _expected_partial(s: Sizes) -> str:
    return (
        f"{s.partial_connections} partial bodies of A (max_concurrent {TENANT_A_CONCURRENCY}): B's "
        f"{s.other_tenant_requests} requests all 200 meanwhile; A holds ≤ {TENANT_A_CONCURRENCY} slots"
    )


PROBES = (
    Probe(
        "unfinished_headers",
        lambda s: (
            f"{s.header_connections} conns × {mib(s.header_bytes)} unfinished head: "
            f"RSS grows < 150 MB, each closed ≤ 30 s"
        ),
        _unfinished_headers,
        lambda s: CLOSE_BOUND_S + 30,
    ),
    Probe(
        "slowloris",
        lambda s: f"{s.slow_connections} conns at 1 byte/s: each closed ≤ 30 s",
        _slowloris,
        lambda s: CLOSE_BOUND_S + 30,
    ),
    Probe("partial_bodies", _expected_partial, _partial_bodies, lambda s: s.body_timeout_s + 60),
    Probe("deep_json", lambda s: f"{DEEP}-deep JSON body → 400", _deep_json, lambda s: 20),
    Probe("tiny_prompt", lambda s: 'completions prompt "hi" → 200, no traceback', _tiny_prompt, lambda s: 30),
    Probe(
        "trailing_slash",
        lambda s: "POST /v1/chat/completions/ → 404, no redirect",
        _trailing_slash,
        lambda s: 20,
    ),
    Probe(
        "metrics_port",
        lambda s: "/metrics: 404 on the client port, 200 on its own",
        _metrics_port,
        lambda s: 20,
    ),
    Probe(
        "regex",
        lambda s: "backtracking volatile pattern runs linear (< 2 s); a non-linear one refused at load",
        _regex,
        lambda s: 90,
    ),
)
