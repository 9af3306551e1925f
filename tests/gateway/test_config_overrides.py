"""Command-line overrides (`--host`, `--port`, `--metrics-port`) are checked as the YAML is, and
the gateway never holds two listeners on one port."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.policy_watch import LoadedPolicy
from gateway.serve import with_listen
from gateway.server import serve
from policies.config import PolicyConfig, build_policy
from tests.support.processes import free_port

SECRET = b"override-test-secret-of-32-bytes"


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "k")]}],
        **extra,
    }


def test_a_port_override_equal_to_the_metrics_port_is_refused() -> None:
    config = parse_config(_config(metrics={"listen": {"port": 9495}}))
    with pytest.raises(ConfigError, match=r"--port 9495: .*metrics.listen.port must differ from listen.port"):
        with_listen(config, None, 9495)


def test_a_metrics_port_override_equal_to_the_client_port_is_refused() -> None:
    config = parse_config(_config(listen={"port": 8181}))
    with pytest.raises(ConfigError, match=r"--metrics-port 8181: .*must differ from listen.port"):
        with_listen(config, None, None, 8181)


def test_an_override_out_of_range_names_the_flag_and_field() -> None:
    with pytest.raises(ConfigError, match=r"--port 70000: .*listen.port"):
        with_listen(parse_config(_config()), None, 70000)


def test_overrides_that_fit_are_applied() -> None:
    config = with_listen(parse_config(_config()), "0.0.0.0", 0, 0)
    assert (config.listen.host, config.listen.port, config.metrics.listen.port) == ("0.0.0.0", 0, 0)
    config = with_listen(parse_config(_config()), None, 9000, 9001)
    assert (config.listen.port, config.metrics.listen.port) == (9000, 9001)
    assert with_listen(parse_config(_config()), None, None) == parse_config(_config())


def test_the_gateway_never_binds_its_metrics_listener_on_the_client_port(
    capfd: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    # A config built around the validator, as an override once could.
    config = parse_config(_config()).model_copy(
        update={
            "listen": parse_config(_config(listen={"port": port})).listen,
            "metrics": parse_config(_config(metrics={"listen": {"port": port}}, listen={"port": 1})).metrics,
        }
    )
    policy_config = PolicyConfig()
    loaded = LoadedPolicy(build_policy(policy_config), policy_config, "")
    assert serve(config, SECRET, loaded) == 2
    assert f"metrics.listen: port {port} is the client port" in capfd.readouterr().err
