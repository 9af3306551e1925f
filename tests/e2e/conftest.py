"""One fake-worker process (several ports, one behaviour each) and one gateway in front of it,
shared by the e2e modules; both are stopped by PID when the session ends."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config

MODES = ("ok", "ok", "error500", "ok", "ok", "die", "slow", "error500", "hang")


@dataclass
class Stack:
    """The running processes and what a test needs to reach them."""

    base_url: str
    workers: dict[str, str]
    gateway: Proc
    fake: Proc


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    names = ["ok1", "ok2", "err500", "ok3", "ok4", "die", "slow", "err500b", "hang"]
    ports = {name: free_port() for name in names}
    down = _url(free_port())  # nothing listens here
    fake = start_fake_workers({ports[n]: mode for n, mode in zip(names, MODES, strict=True)})
    gateway: Proc | None = None
    try:
        w = {n: _url(p) for n, p in ports.items()}
        w["down"] = down
        fast = {"health": {"interval_s": 0.5, "timeout_s": 0.5}}
        pools = [
            {"name": "ok", "models": ["m-ok"], "workers": [w["ok1"], w["ok2"]], **fast},
            {"name": "retry", "models": ["m-retry"], "workers": [w["err500"], w["ok3"]], **fast},
            {"name": "down", "models": ["m-down"], "workers": [down, w["ok4"]], **fast},
            {"name": "die", "models": ["m-die"], "workers": [w["die"]], **fast},
            {"name": "slow", "models": ["m-slow"], "workers": [w["slow"]], **fast},
            {"name": "all500", "models": ["m-500"], "workers": [w["err500b"]], "retry_attempts": 1, **fast},
            {"name": "nothing", "models": ["m-none"], "workers": [down], **fast},
            {
                "name": "hang",
                "models": ["m-hang"],
                "workers": [w["hang"]],
                "timeouts": {"read_s": 0.5},
                **fast,
            },
        ]
        tenants = [
            tenant("acme", "sk-acme"),
            tenant("globex", "sk-globex"),
            tenant("pub", "sk-pub", isolation="public"),
            tenant("rpm", "sk-rpm", quotas={"rpm": 2}),
            tenant("tpm", "sk-tpm", quotas={"tpm": 100}),
            tenant("one", "sk-one", quotas={"max_concurrent": 1}),
        ]
        config = write_gateway_config(
            tmp_path_factory.mktemp("gw") / "gateway.yaml", pools, tenants, limits={"max_body_bytes": 65536}
        )
        port = free_port()
        gateway = start_gateway(config, port)
        yield Stack(f"http://127.0.0.1:{port}", w, gateway, fake)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


@pytest.fixture()
def gateway_log(stack: Stack) -> Path:
    return stack.gateway.log_path
