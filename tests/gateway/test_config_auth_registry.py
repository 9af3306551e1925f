import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.auth import KeyRing, hash_api_key
from gateway.config import TenantConfig, load_config, parse_config, read_secret
from gateway.config.base import ConfigError
from gateway.config.pool import PoolConfig
from gateway.registry import Pool
from policies.base import Isolation
from policies.identity import TenantIdentity

SECRET = b"s3cret"


def _minimal(**extra: Any) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "k")]}],
        **extra,
    }


def test_minimal_config_gets_safe_defaults() -> None:
    cfg = parse_config(_minimal())
    assert cfg.listen.host == "127.0.0.1" and cfg.listen.port == 8080
    assert cfg.tenants[0].isolation is Isolation.STRICT
    assert cfg.pools[0].timeouts.connect_s > 0 and cfg.pools[0].retry_attempts == 2


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"listen": {"port": 99999}}, "listen.port"),
        ({"colour": "red"}, "colour"),
        ({"pools": [{"name": "p", "models": [], "workers": []}]}, "pools.0.models"),
        ({"pools": [{"name": "p", "models": ["m"], "workers": ["127.0.0.1:1"]}]}, "pools.0.workers"),
        ({"tenants": [{"name": "t", "api_key_hashes": ["sk-plaintext"]}]}, "tenants.0.api_key_hashes"),
        (
            {"tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "k")], "isolation": "x"}]},
            "tenants.0.isolation",
        ),
        (
            {"tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "k")], "quotas": {"rpm": 0}}]},
            "tenants.0.quotas.rpm",
        ),
    ],
)
def test_errors_name_the_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        parse_config(_minimal(**patch))


def test_a_pool_needs_static_workers_or_dns_discovery() -> None:
    with pytest.raises(ConfigError, match="exactly one of 'workers' \\(static URLs\\), 'dns'"):
        parse_config(_minimal(pools=[{"name": "p", "models": ["m"]}]))
    both = {"name": "p", "models": ["m"], "workers": ["http://a:1"], "dns": {"name": "h", "port": 80}}
    with pytest.raises(ConfigError, match="exactly one of 'workers' \\(static URLs\\), 'dns'"):
        parse_config(_minimal(pools=[both]))
    dns = parse_config(
        _minimal(pools=[{"name": "p", "models": ["m"], "dns": {"name": "vllm", "port": 8000}}])
    )
    assert dns.pools[0].dns is not None and dns.pools[0].dns.refresh_s == 5.0


def test_a_model_in_two_pools_is_refused() -> None:
    pools = [
        {"name": "a", "models": ["m"], "workers": ["http://127.0.0.1:1"]},
        {"name": "b", "models": ["m"], "workers": ["http://127.0.0.1:2"]},
    ]
    with pytest.raises(ConfigError, match="served by pools"):
        parse_config(_minimal(pools=pools))


def test_secret_comes_from_env_or_file_never_yaml(tmp_path: Path) -> None:
    cfg = parse_config(_minimal())
    assert read_secret(cfg.secrets, {"KVGATE_KEY_SECRET": "a" * 32}) == b"a" * 32
    with pytest.raises(ConfigError, match="KVGATE_KEY_SECRET"):
        read_secret(cfg.secrets, {})
    (tmp_path / "secret").write_text("from-file-" * 4 + "\n")
    path = tmp_path / "gw.yaml"
    path.write_text(
        yaml.safe_dump(_minimal(secrets={"key_hash_secret_file": "secret"}, policy_file="p.yaml"))
    )
    loaded = load_config(path)
    assert read_secret(loaded.secrets, {}) == b"from-file-" * 4
    assert loaded.policy_file == str(tmp_path / "p.yaml")


def test_config_file_bounds_what_its_yaml_aliases_expand_to(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    text = yaml.safe_dump(_minimal())
    # Sharing a value is fine (a mapping reused by two pools, as yaml.safe_dump writes it) ...
    config = _minimal()
    config["pools"] = [config["pools"][0], {**config["pools"][0], "name": "p2", "models": ["m2"]}]
    health = {"interval_s": 2.0}
    config["pools"][0]["health"] = config["pools"][1]["health"] = health
    path.write_text(yaml.safe_dump(config))
    assert "&id001" in path.read_text()
    assert [p.health.interval_s for p in load_config(path).pools] == [2.0, 2.0]
    bomb = "".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]\n" for i in range(1, 8))
    path.write_text(text + "b0: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + bomb)  # ... 10^8 values is not
    with pytest.raises(ConfigError, match="expands to more than 1,000,000 values"):
        load_config(path)


def test_keyring_maps_keys_to_tenants_with_distinct_salts() -> None:
    tenants = [
        TenantConfig(name="a", api_key_hashes=[hash_api_key(SECRET, "ka")]),
        TenantConfig(name="b", api_key_hashes=[hash_api_key(SECRET, "kb")], isolation=Isolation.PUBLIC),
    ]
    ring = KeyRing(tenants, SECRET)
    a, b = ring.lookup("Bearer ka"), ring.lookup("bearer kb")
    assert a is not None and b is not None and a.name == "a" and b.name == "b"
    assert a.cache_salt != b.cache_salt and re.fullmatch("[0-9a-f]{32}", a.cache_salt)
    assert (
        ring.lookup("Bearer nope") is None and ring.lookup(None) is None and ring.lookup("Basic ka") is None
    )
    assert KeyRing(tenants, b"other").lookup("Bearer ka") is None  # the hash is keyed
    # Repeated lookups come from the cache (same answer, no plain key stored); misses stay misses.
    for _ in range(3):
        assert ring.lookup("Bearer ka") is a and ring.lookup("Bearer nope") is None
    assert len(ring._cache) == 2 and all(isinstance(k, bytes) and b"ka" not in k for k in ring._cache)
    assert ring.public_salt not in (a.cache_salt, b.cache_salt)
    assert ring.salt_namespaces[a.cache_salt] == "tenant:a"
    # A tenant is its policies identity plus key hashes and quotas.
    assert ring.directory.tenants["b"] == TenantIdentity("b", "tenant:b", Isolation.PUBLIC, b.cache_salt)
    assert b.api_key_hashes == (hash_api_key(SECRET, "kb"),) and b.quotas == tenants[1].quotas


def test_pool_set_urls_keeps_state_of_surviving_workers() -> None:
    pool = Pool(PoolConfig(name="p", models=["m"], workers=["http://a:1", "http://b:1"]))
    a = pool.workers[next(iter(pool.workers))]
    a.acquire(100, 10, 0.0)
    a.record_health(True, pool.config)
    pool.set_urls(["http://a:1", "http://c:1"])
    assert list(pool.workers) == ["http://a:1", "http://c:1"]
    assert pool.workers[a.worker_id] is a and a.in_flight == 1 and a.healthy
    assert not pool.workers["http://c:1"].healthy  # unknown until checked  # type: ignore[index]


def test_load_accounting_never_goes_negative_and_tracks_prefill() -> None:
    pool = Pool(PoolConfig(name="p", models=["m"], workers=["http://a:1"]))
    (w,) = pool.workers.values()
    w.acquire(100, 20, 0.0)
    assert (w.in_flight, w.prefill_tokens, w.decode_tokens) == (1, 100, 20)
    w.first_token(100)
    assert w.prefill_tokens == 0
    w.release(100, 20, prefill_done=True)
    w.release(100, 20, prefill_done=False)
    assert (w.in_flight, w.prefill_tokens, w.decode_tokens) == (0, 0, 0)


def test_health_needs_a_streak_to_go_down_but_unknown_stays_down() -> None:
    cfg = PoolConfig(name="p", models=["m"], workers=["http://a:1"])
    pool = Pool(cfg)
    (w,) = pool.workers.values()
    w.record_health(False, cfg)
    assert not w.healthy
    w.record_health(True, cfg)
    assert w.healthy
    w.record_health(False, cfg)
    assert w.healthy  # one failure is not a streak
    w.record_health(False, cfg)
    assert not w.healthy
    views = pool.views(0.0)
    assert not views[0].healthy
