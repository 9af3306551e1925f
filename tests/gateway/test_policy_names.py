"""A policy file that tunes a pool or tenant the gateway config does not have is warned of: its
settings apply to nothing (a typo, or a file written for another gateway)."""

from __future__ import annotations

import logging

import pytest

from gateway.config import parse_config
from gateway.state import warn_unknown_names
from policies.config import parse_policy_yaml

HASH = "hmac-sha256:" + "0" * 64
CONFIG = parse_config(
    {
        "pools": [{"name": "llama", "models": ["m"], "workers": ["http://127.0.0.1:8000"]}],
        "tenants": [{"name": "team-a", "api_key_hashes": [HASH]}],
    }
)


def test_names_the_gateway_does_not_have_are_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    policy = parse_policy_yaml(
        "pools: {llama: {capacity_fraction: 0.8}, chat: {capacity_fraction: 0.7}}\n"
        "tenants: {team-a: {index_share: 0.2}, acme: {index_share: 0.1}}\n"
    )
    with caplog.at_level(logging.WARNING):
        assert warn_unknown_names(CONFIG, policy) == ["pools.chat", "tenants.acme"]
    assert "pools.chat is not in the gateway config" in caplog.text
    assert warn_unknown_names(CONFIG, parse_policy_yaml("pools: {llama: {capacity_fraction: 0.8}}\n")) == []
