"""The sync block's credentials, the chart's (from sync.auth) merged with config.sync's, refused at
install exactly when the gateway would refuse them at start: the same values rendered by a copy of
the chart without the check are parsed by the gateway's own config model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest

from gateway.config import ConfigError, parse_config
from tests.helm.chart import CHART, REQUIRED, gateway_config, render_raw

CHECK = '{{- include "kvgate.checkSyncAuth" $cfg }}\n'
NATS_URL = "nats://nats.messaging.svc:4222"
SENTINEL_URL = "redis+sentinel://s1.cache.svc:26379,s2.cache.svc:26379/primary"
TOKEN = "a1" * 20

CASES: list[dict[str, Any]] = [
    {},  # the chart's broker and its generated token, from a file
    {"config": {"sync": {"auth": {"token_env": "SYNC_TOKEN"}}}},  # and from the environment too
    {"sync": {"auth": {"token": TOKEN}}, "config": {"sync": {"auth": {"user": "kvgate"}}}},
    {"sync": {"url": "redis://valkey.cache.svc:6379", "auth": {"token": TOKEN, "user": "kvgate"}}},
    {"sync": {"url": NATS_URL}, "config": {"sync": {"auth": {"user": "u", "password_env": "P"}}}},
    {"sync": {"url": NATS_URL}, "config": {"sync": {"auth": {"user": "u"}}}},
    {"sync": {"url": NATS_URL}, "config": {"sync": {"auth": {"password_env": "P"}}}},
    {
        "sync": {"url": NATS_URL},
        "config": {"sync": {"auth": {"user": "u", "password_file": "/p", "password_env": "P"}}},
    },
    {"sync": {"url": NATS_URL}, "config": {"sync": {"auth": {"token_env": "T"}}}},
    {"sync": {"url": NATS_URL}, "config": {"sync": {"sentinel_auth": {"token_env": "S"}}}},
    {"sync": {"url": SENTINEL_URL}, "config": {"sync": {"sentinel_auth": {"token_env": "S"}}}},
    {
        "sync": {"url": SENTINEL_URL},
        "config": {"sync": {"sentinel_auth": {"token_env": "S", "token_file": "/s"}}},
    },
    {"sync": {"url": SENTINEL_URL}, "config": {"sync": {"sentinel_auth": {"password_env": "S"}}}},
    {"sync": {"enabled": False}, "config": {"sync": {"sentinel_auth": {"token_env": "S"}}}},
]


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart without the check: what it would render otherwise."""
    chart = tmp_path_factory.mktemp("unchecked") / "kvgate"
    shutil.copytree(CHART, chart)
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert text.count(CHECK) == 1, "the check moved: update this test"
    helpers.write_text(text.replace(CHECK, ""))
    return chart


def _gateway_accepts(values: dict[str, Any], chart: Path) -> bool:
    try:
        parse_config(gateway_config(render_raw(values, chart_dir=chart)))
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_chart_refuses_the_credentials_the_gateway_refuses(case: int, unchecked: Path) -> None:
    values = REQUIRED | CASES[case]
    expected = _gateway_accepts(values, unchecked)
    try:
        render_raw(values)
    except helm_python.HelmError as exc:
        assert not expected, exc
        assert "sync" in str(exc) and "the gateway" in str(exc)
    else:
        assert expected, CASES[case]


def test_both_verdicts_occur() -> None:
    """The cases hold configs the gateway takes and configs it refuses (else the comparison above
    would prove little)."""
    accepted = [v for v in CASES if _renders(REQUIRED | v)]
    assert 0 < len(accepted) < len(CASES)


def _renders(values: dict[str, Any]) -> bool:
    try:
        render_raw(values)
    except helm_python.HelmError:
        return False
    return True


def test_the_messages_say_what_to_change() -> None:
    with pytest.raises(helm_python.HelmError, match=r"token_file .* and token_env \(SYNC_TOKEN\)"):
        render_raw(REQUIRED | CASES[1])
    with pytest.raises(helm_python.HelmError, match=r"sentinel_auth .* redis\+sentinel://"):
        render_raw(REQUIRED | CASES[9])
