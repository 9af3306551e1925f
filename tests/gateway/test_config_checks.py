"""Config values that used to pass validation and fail later, or pass when they should not:
`log_level`, duplicate keys in the YAML, a short key-hash secret, infinite times."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.auth import hash_api_key
from gateway.config import MIN_KEY_HASH_SECRET_BYTES, SecretsConfig, load_config, parse_config, read_secret
from gateway.config.base import ConfigError
from gateway.kv_event_types import endpoint_for_worker
from gateway.logs import setup_logging
from tests.gateway.logging_state import logging_restored

SECRET = b"config-checks-secret-of-32-bytes"


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "k")]}],
        **extra,
    }


@pytest.mark.parametrize("level", ["debug", "INFO", "Warning", "error", "CRITICAL"])
def test_log_levels_are_taken_in_any_case(level: str) -> None:
    config = parse_config(_config(log_level=level))
    assert config.log_level == level.lower()
    # setup_logging sets the process's root and "kvgate" loggers: given back as found, or every
    # later test in this process (which ones, xdist's file grouping decides) logs at this test's
    # level, to a stderr captured for this test only.
    with logging_restored():
        setup_logging(config.log_level)
        assert logging.getLogger("kvgate").level == logging.getLevelName(level.upper())


@pytest.mark.parametrize("level", ["bogus", "", "10", "notset"])
def test_an_unknown_log_level_is_refused_naming_the_field(level: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("log_level: Value error, must be one of debug, info")):
        parse_config(_config(log_level=level))


def test_a_key_said_twice_in_the_config_file_is_refused(tmp_path: Path) -> None:
    text = yaml.safe_dump(_config())
    path = tmp_path / "gw.yaml"
    path.write_text(text + "listen:\n  port: 8081\n  port: 8082\n")
    with pytest.raises(ConfigError, match=re.escape("duplicate key 'listen.port' on line")):
        load_config(path)
    path.write_text(text + "log_level: info\n" + text.splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match=r"duplicate key '\w+'"):
        load_config(path)


def test_a_key_hash_secret_shorter_than_32_bytes_is_refused_never_shown(tmp_path: Path) -> None:
    short = "s" * (MIN_KEY_HASH_SECRET_BYTES - 1)
    env = SecretsConfig()
    with pytest.raises(ConfigError, match="environment variable KVGATE_KEY_SECRET is shorter than 32") as exc:
        read_secret(env, {"KVGATE_KEY_SECRET": short})
    assert short not in str(exc.value)
    assert read_secret(env, {"KVGATE_KEY_SECRET": short + "s"}) == (short + "s").encode()
    (tmp_path / "secret").write_text(short + "\n")  # trailing whitespace is not counted
    in_file = SecretsConfig(key_hash_secret_file=str(tmp_path / "secret"))
    with pytest.raises(ConfigError, match=r"secrets\.key_hash_secret_file: .* is shorter than 32") as exc:
        read_secret(in_file, {"KVGATE_KEY_SECRET": short + "s"})
    assert short not in str(exc.value)
    (tmp_path / "secret").write_bytes(bytes(range(128, 160)))  # random bytes count as they are
    assert read_secret(in_file, {}) == bytes(range(128, 160))


@pytest.mark.parametrize("field", ["kv_events_endpoint", "kv_events_replay_endpoint"])
@pytest.mark.parametrize("template", ["tcp://{host.ip}:5557", "tcp://{host:>99999999}:5557", "tcp://{port}"])
def test_an_endpoint_template_with_another_placeholder_is_refused_at_load(field: str, template: str) -> None:
    config = _config()
    config["pools"][0][field] = template
    with pytest.raises(ConfigError, match=field):
        parse_config(config)


def test_an_endpoint_template_fills_host_by_plain_substitution() -> None:
    config = _config()
    config["pools"][0]["kv_events_endpoint"] = "tcp://{host}:5557"
    pool = parse_config(config).pools[0]
    assert pool.kv_events_endpoint is not None
    assert endpoint_for_worker(pool.kv_events_endpoint, "http://[fd00::7]:8000") == "tcp://[fd00::7]:5557"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"upstream": {"keepalive_timeout_s": float("inf")}}, "upstream.keepalive_timeout_s"),
        ({"limits": {"keepalive_timeout_s": float("inf")}}, "limits.keepalive_timeout_s"),
        ({"drain": {"deadline_s": float("nan")}}, "drain.deadline_s"),
    ],
)
def test_an_infinite_or_nan_setting_is_refused_naming_the_field(extra: dict[str, Any], field: str) -> None:
    # YAML's `.inf` passed `gt=0` and crashed the start with an OverflowError far from the setting.
    with pytest.raises(ConfigError, match=re.escape(field) + ".*finite number"):
        parse_config(_config(**extra))


def test_an_infinite_health_timeout_in_a_pool_is_refused() -> None:
    config = _config()
    config["pools"][0]["health"] = {"timeout_s": float("inf")}
    with pytest.raises(ConfigError, match=r"pools\.0\.health\.timeout_s.*finite number"):
        parse_config(config)


def test_a_name_or_key_said_twice_is_named() -> None:
    # The operator is told which pool, tenant or tenants (never the hash, never a URL that may
    # carry credentials).
    two_pools = _config()
    two_pools["pools"].append({**two_pools["pools"][0], "models": ["m2"]})
    with pytest.raises(ConfigError, match="pool names must be unique: 'p' names two pools"):
        parse_config(two_pools)
    shared_key = _config()
    shared_key["tenants"].append({**shared_key["tenants"][0], "name": "t2"})
    with pytest.raises(ConfigError, match="an API key hash is listed twice, by tenants 't' and 't2'"):
        parse_config(shared_key)
    urls = _config()
    urls["pools"][0]["workers"] = ["http://a:1", "http://h:1", "http://h:1"]
    with pytest.raises(ConfigError, match="URL 3 of the 3 in that order repeats URL 2"):
        parse_config(urls)


def test_a_worker_url_with_credentials_is_refused_without_echoing_them() -> None:
    # The URL is a metrics label (on the unauthenticated metrics port), a log field and an admin
    # value: a password in it would be published.
    for role in ("workers", "prefill_workers"):
        config = _config()
        config["pools"][0][role] = ["http://kvuser:SuperSecretPw@127.0.0.1:18101"]
        if role != "workers":
            config["pools"][0]["pd"] = {}
            config["pools"][0]["decode_workers"] = ["http://127.0.0.1:18102"]
        with pytest.raises(ConfigError, match="must not carry credentials") as refused:
            parse_config(config)
        assert "SuperSecretPw" not in str(refused.value)
