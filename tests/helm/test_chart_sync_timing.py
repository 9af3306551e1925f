"""The sync timings the gateway refuses at start (a peer timeout not above the load refresh) are
refused when the chart renders, for the same values, whether they come from `sync.*` or from
`config.sync`, a null or a key left out meaning the gateway's default."""

from __future__ import annotations

from typing import Any

import helm_python
import pydantic
import pytest

from gateway.config import parse_config
from gateway.config.sync import SyncConfig
from tests.helm.chart import gateway_config, render

# (sync.loadRefreshS, sync.peerTimeoutS): None is null in the values (the gateway's default).
PAIRS: list[tuple[float | None, float | None]] = [
    (None, None),
    (None, 1.0),  # the default refresh (1 s): equal is refused
    (None, 1.5),
    (5.0, None),  # the default timeout (5 s): equal is refused
    (4.9, None),
    (6, None),
    (2, 2),
    (2, 2.5),
    (0.5, 0.4),
    (0.25, 0.3),
]


def _gateway_accepts(refresh: float | None, timeout: float | None) -> bool:
    given = {"load_refresh_s": refresh, "peer_timeout_s": timeout}
    try:
        SyncConfig.model_validate({key: value for key, value in given.items() if value is not None})
    except pydantic.ValidationError:
        return False
    return True


def _renders(values: dict[str, Any]) -> bool:
    try:
        docs = render(values)
    except helm_python.HelmError as exc:
        assert "must be longer than sync.loadRefreshS" in str(exc)
        return False
    parse_config(gateway_config(docs))  # what renders, the gateway starts with
    return True


@pytest.mark.parametrize(("refresh", "timeout"), PAIRS)
def test_the_chart_refuses_what_the_gateway_refuses(refresh: float | None, timeout: float | None) -> None:
    expected = _gateway_accepts(refresh, timeout)
    assert _renders({"sync": {"loadRefreshS": refresh, "peerTimeoutS": timeout}}) is expected
    # The same keys of the gateway config, which win over the chart's values.
    given = {"load_refresh_s": refresh, "peer_timeout_s": timeout}
    config = {"sync": {key: value for key, value in given.items() if value is not None}}
    assert _renders({"config": config}) is expected
    # One from each place.
    mixed: dict[str, Any] = {"sync": {"loadRefreshS": refresh}}
    if timeout is not None:
        mixed["config"] = {"sync": {"peer_timeout_s": timeout}}
    assert _renders(mixed) is expected


def test_config_sync_wins_over_the_values() -> None:
    # The values alone would be refused; config.sync's timeout is the one the gateway runs with.
    values = {"sync": {"loadRefreshS": 3, "peerTimeoutS": 2}, "config": {"sync": {"peer_timeout_s": 9}}}
    assert _renders(values)
    # The values alone would pass; config.sync's refresh makes the pair one the gateway refuses.
    assert not _renders({"sync": {"peerTimeoutS": 4}, "config": {"sync": {"load_refresh_s": 4}}})


def test_checked_with_sync_off_too() -> None:
    """The gateway validates its sync block whether or not a url turns sync on."""
    assert not _renders({"sync": {"enabled": False}, "config": {"sync": {"peer_timeout_s": 0.5}}})
    assert _renders({"sync": {"enabled": False}, "config": {"sync": {"peer_timeout_s": 1.5}}})


def test_the_message_names_the_values_and_the_defaults() -> None:
    with pytest.raises(helm_python.HelmError) as caught:
        render({"sync": {"peerTimeoutS": 1}})
    message = str(caught.value)
    assert "sync.peerTimeoutS (1) must be longer than sync.loadRefreshS (1)" in message
    assert "the gateway's 5 and 1 s" in message


def test_the_charts_defaults_are_the_gateways() -> None:
    fields = SyncConfig.model_fields
    # A timeout just above the gateway's default refresh renders, one at it does not; and the
    # reverse for a refresh against the default timeout.
    refresh, timeout = fields["load_refresh_s"].default, fields["peer_timeout_s"].default
    assert _renders({"sync": {"peerTimeoutS": refresh * 1.01}})
    assert not _renders({"sync": {"peerTimeoutS": refresh}})
    assert _renders({"sync": {"loadRefreshS": timeout * 0.99}})
    assert not _renders({"sync": {"loadRefreshS": timeout}})
