"""`kvgate serve` refuses what it cannot run at start: exit 2 and one line naming the field (or
the flag), never a traceback, and never a secret's value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import SECRET, free_port, tenant, write_gateway_config

POOLS = [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}]


def serve(*argv: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`kvgate serve ARGV` to its end; each case here must end before anything is served."""
    base = {k: v for k, v in os.environ.items() if k != "KVGATE_KEY_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", *argv],
        env={**base, "KVGATE_KEY_SECRET": SECRET.decode(), **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def _config(tmp_path: Path, **extra: object) -> Path:
    return write_gateway_config(tmp_path / "gw.yaml", POOLS, [tenant("t", "sk-t")], **extra)


def test_a_port_override_equal_to_the_metrics_port_exits_2(tmp_path: Path) -> None:
    port = free_port()
    path = _config(tmp_path, metrics={"listen": {"port": port}})
    proc = serve("--config", str(path), "--port", str(port))
    assert_refused(proc, f"kvgate serve: --port {port}: ")
    assert "metrics.listen.port must differ from listen.port" in proc.stderr


def test_a_metrics_port_override_equal_to_the_client_port_exits_2(tmp_path: Path) -> None:
    port = free_port()
    path = _config(tmp_path, listen={"port": port})
    assert_refused(
        serve("--config", str(path), "--metrics-port", str(port)),
        "metrics.listen.port must differ from listen.port",
    )


def test_the_processes_metrics_ports_must_not_include_the_client_port(tmp_path: Path) -> None:
    port = free_port()
    proc = serve(
        "--config", str(_config(tmp_path)), "--processes", "2", "--port", str(port),
        "--metrics-port", str(port - 1),
    )  # fmt: skip
    assert_refused(proc, f"include the client port {port}")


def test_the_demo_checks_its_ports_before_starting_workers() -> None:
    proc = serve("--demo", "--port", "9464")
    assert_refused(proc, "metrics.listen.port must differ from listen.port")
    assert "kvgate demo:" not in proc.stdout


def test_an_unknown_log_level_in_the_config_exits_2(tmp_path: Path) -> None:
    proc = serve("--config", str(_config(tmp_path, log_level="bogus")))
    assert_refused(proc, "log_level")


def test_an_unknown_log_level_flag_is_refused_by_the_parser() -> None:
    proc = serve("--demo", "--log-level", "bogus")
    assert proc.returncode == 2 and "invalid choice: 'bogus'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_duplicate_key_in_the_config_exits_2_naming_it(tmp_path: Path) -> None:
    path = _config(tmp_path)
    path.write_text(path.read_text() + "log_level: info\nlog_level: debug\n")
    assert_refused(serve("--config", str(path)), "duplicate key 'log_level'")


def test_a_duplicate_key_in_the_policy_file_exits_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("cost:\n  epsilon: 0.5\n  epsilon: 0.7\n")
    path = _config(tmp_path, policy_file="policy.yaml")
    assert_refused(serve("--config", str(path)), "duplicate key 'cost.epsilon'")


SHORT = "short-key-hash-secret"


def test_a_short_key_hash_secret_exits_2_naming_the_variable(tmp_path: Path) -> None:
    proc = serve("--config", str(_config(tmp_path)), env={"KVGATE_KEY_SECRET": SHORT})
    assert_refused(proc, "KVGATE_KEY_SECRET")
    assert "shorter than 32 bytes" in proc.stderr and SHORT not in proc.stderr


def test_a_short_key_hash_secret_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SHORT + "\n")
    path = _config(tmp_path, secrets={"key_hash_secret_file": "secret"})
    proc = serve("--config", str(path))
    assert_refused(proc, "secrets.key_hash_secret_file")
    assert "shorter than 32 bytes" in proc.stderr and SHORT not in proc.stderr


def test_hash_key_refuses_a_short_secret_too() -> None:
    proc = serve("--hash-key", env={"KVGATE_KEY_SECRET": SHORT}, stdin="sk-x\n")
    assert_refused(proc, "KVGATE_KEY_SECRET")
    assert proc.stdout == "" and SHORT not in proc.stderr


def test_a_tokenizer_directory_that_cannot_be_read_exits_2(tmp_path: Path) -> None:
    pools = [{**POOLS[0], "normalizer": {"mode": "tokenizer", "tokenizer_dir": str(tmp_path / "none")}}]
    path = write_gateway_config(tmp_path / "gw.yaml", pools, [tenant("t", "sk-t")])
    assert_refused(serve("--config", str(path)), f"cannot load tokenizer from {tmp_path / 'none'}")


def test_a_kubernetes_pool_outside_a_cluster_exits_2(tmp_path: Path) -> None:
    pools = [
        {
            "name": "k",
            "models": ["m"],
            "kubernetes": {"selector": "app=vllm", "namespace": "llm", "port": 8000},
        }
    ]
    path = write_gateway_config(tmp_path / "gw.yaml", pools, [tenant("t", "sk-t")])
    env = {"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": ""}
    assert_refused(
        serve("--config", str(path), env=env), "pool 'k': KUBERNETES_SERVICE_HOST/PORT are not set"
    )


def test_a_missing_or_invalid_workers_file_exits_2(tmp_path: Path) -> None:
    pools = [{"name": "f", "models": ["m"], "workers_file": {"path": "workers.yaml"}}]
    path = write_gateway_config(tmp_path / "gw.yaml", pools, [tenant("t", "sk-t")])
    assert_refused(serve("--config", str(path)), "pool 'f': workers_file: No such file or directory")
    (tmp_path / "workers.yaml").write_text("- http://127.0.0.1:1/v1\n")
    assert_refused(serve("--config", str(path)), "pool 'f': entry 0: a worker is a base URL")
