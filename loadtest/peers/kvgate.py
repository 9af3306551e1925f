"""kvgate itself as one of the routers of a benchmark: its config file and command line.

The gateway reads tenants' API keys as keyed hashes (`policies.identity.hash_api_key`) and the secret
from `KVGATE_KEY_SECRET`; every workload tenant gets its own key `sk-bench-<tenant>`, strict
isolation, and the policy comes from a policy file.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from loadtest.peers.launch import PeerCommand
from policies.identity import hash_api_key

BENCH_SECRET = "kvgate-bench-key-hash-secret-32-bytes"


def bench_api_key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


def build_kvgate_command(
    *,
    policy: str,
    port: int,
    worker_urls: Sequence[str],
    model: str,
    tenants: Sequence[str],
    seed: int,
    workdir: Path,
    decision_log: Path | None = None,
    pd_mode: str | None = None,
    pd_holder_share: float | None = None,
    policy_options: Mapping[str, object] | None = None,
) -> PeerCommand:
    """Write `gateway.yaml` + `policy.yaml` into `workdir` and return the `serve` command; with
    `decision_log`, the gateway writes its routing decisions there (`gateway/decision_log.py`);
    with `pd_mode` (e.g. `holder_prefill`) the pool gets a vLLM `pd` section in that mode, with
    `pd.holder_share` when `pd_holder_share` is given; `policy_options` go into the policy file
    beside `policy` (a `seed` among them wins over `seed`)."""
    secret = BENCH_SECRET.encode()
    policy_doc = {"policy": policy, "seed": seed, **(policy_options or {})}
    (workdir / "policy.yaml").write_text(yaml.safe_dump(policy_doc))
    pool: dict[str, object] = {
        "name": "bench",
        "models": [model],
        "workers": list(worker_urls),
        "health": {"interval_s": 1.0, "timeout_s": 1.0},
        "timeouts": {"read_s": 600.0, "total_s": 1200.0},
    }
    if pd_mode is not None:
        pd: dict[str, object] = {"protocol": "vllm", "mode": pd_mode}
        if pd_holder_share is not None:
            pd["holder_share"] = pd_holder_share
        pool["pd"] = pd
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "metrics": {"listen": {"host": "127.0.0.1", "port": 0}},  # any free port: runs side by side
        "policy_file": "policy.yaml",
        "log_level": "warning",
        "pools": [pool],
        "tenants": [
            {"name": t, "api_key_hashes": [hash_api_key(secret, bench_api_key(t))], "isolation": "strict"}
            for t in sorted(set(tenants))
        ],
    }
    if decision_log is not None:
        config["decision_log"] = {"path": str(decision_log.resolve())}
    config_path = workdir / "gateway.yaml"
    text = yaml.safe_dump(config, sort_keys=False)
    argv = (sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path))
    name = f"kvgate:{policy}" if pd_mode is None else f"kvgate:{policy}+{pd_mode}"
    if pd_mode is not None and pd_holder_share is not None:
        name += f"@{pd_holder_share:g}"
    return PeerCommand(
        name,
        policy,
        argv,
        {"KVGATE_KEY_SECRET": BENCH_SECRET},
        config_path,
        text,
        ready_path="/readyz",  # ready once the pool has a healthy worker
        port=port,
    )
