"""A gateway run from a checkout (`--gateway-root`), for benchmarks that compare two commits.

The benchmark's own code is this tree's; the gateway under test is the checkout's, started with
the checkout's CLI (its key hashing included, so the tenant's key matches whatever that commit
does). One tenant whose key is `key`, the pools and limits given, and a policy file naming
`policy`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest.overhead_load import wait_ready
from loadtest.ports import free_port

READY_TIMEOUT_S = 60.0


def start_gateway(
    root: Path,
    folder: Path,
    *,
    secret: str,
    key: str,
    pools: list[dict[str, Any]],
    policy: str,
    limits: dict[str, Any] | None = None,
    metrics_port: int | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """The checkout's gateway on a free port, ready; its config, policy file and log in `folder`
    (a gateway that exits or is not ready in time: `RuntimeError` with the log's tail, and it is
    killed). Its metrics listener is on `metrics_port` (default: a free port)."""
    env = {**os.environ, "PYTHONPATH": str(root), "KVGATE_KEY_SECRET": secret}
    hashed = (
        subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--hash-key"],
            input=key.encode(),
            env=env,
            cwd=root,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    (folder / "policy.yaml").write_text(f"policy: {policy}\n")
    config: dict[str, Any] = {
        "policy_file": "policy.yaml",
        "pools": pools,
        "tenants": [{"name": "bench", "api_key_hashes": [hashed]}],
    }
    if limits:  # a checkout that lacks a limit refuses the key: given only when asked for
        config["limits"] = limits
    (folder / "gateway.json").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(folder / "gateway.json")]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port or free_port())]
    proc = start_ready(argv, env, root, folder / "gateway.log", f"http://127.0.0.1:{port}/readyz")
    return proc, port


def start_ready(
    argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, ready_url: str
) -> subprocess.Popen[bytes]:
    """`argv` run in `cwd` with its output in `log_path`, once `ready_url` answers; one that exits
    or is not ready in time is killed (`RuntimeError` with the log's tail)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(ready_url, proc, log_path, READY_TIMEOUT_S)
    except BaseException:
        proc.kill()
        raise
    return proc
