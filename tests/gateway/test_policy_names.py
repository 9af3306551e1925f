"""A policy file that tunes a pool or tenant the gateway config does not have is warned of: its
settings apply to nothing (a typo, or a file written for another gateway)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The warnings of the module's own logger meanwhile: on it, since the gateway's logging
    set-up (another test's, in this process) may stop it propagating to the root, and at the
    level it is read at, since that set-up may have left the root's above warning."""
    handler, logger = _Lines(), logging.getLogger("kvgate.policy_watch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_names_the_gateway_does_not_have_are_warned_of() -> None:
    policy = parse_policy_yaml(
        "pools: {llama: {capacity_fraction: 0.8}, chat: {capacity_fraction: 0.7}}\n"
        "tenants: {team-a: {index_share: 0.2}, acme: {index_share: 0.1}}\n"
    )
    with _warnings() as lines:
        assert warn_unknown_names(CONFIG, policy) == ["pools.chat", "tenants.acme"]
    assert any("pools.chat is not in the gateway config" in line for line in lines)
    assert warn_unknown_names(CONFIG, parse_policy_yaml("pools: {llama: {capacity_fraction: 0.8}}\n")) == []


def test_a_section_of_another_policy_is_warned_of() -> None:
    other = parse_policy_yaml("policy: round_robin\ncost: {epsilon: 0.9}\npreble_e2: {window_s: 60}\n")
    with _warnings() as lines:
        assert warn_unknown_names(CONFIG, other) == ["cost", "preble_e2"]
    assert any("cost is not the running policy (round_robin)" in line for line in lines)
    assert warn_unknown_names(CONFIG, parse_policy_yaml("policy: cost\ncost: {epsilon: 0.9}\n")) == []
