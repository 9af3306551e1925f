"""One fake-worker process (several ports, one behaviour each) and one gateway in front of it,
shared by the e2e modules; both are stopped by PID when the session ends."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import Proc, free_port, start_fake_workers, start_gateway, tenant, write_gateway_config
from tests.support.wait import wait_until_sync

MODES = ("ok", "ok", "once500", "once500", "ok", "die", "slow", "error500", "hang", "reject400")


@dataclass
class Stack:
    """The running processes and what a test needs to reach them."""

    base_url: str
    metrics_url: str
    workers: dict[str, str]
    gateway: Proc
    fake: Proc

    def wait_routable(self, pool: str, workers: int, timeout_s: float = 15.0) -> None:
        """Wait until `workers` workers of `pool` are healthy with closed breakers (gateway metrics)."""
        pattern = re.compile(rf'kvgate_worker_healthy{{pool="{re.escape(pool)}",worker="[^"]+"}} 1\.0')

        def routable() -> int:
            return len(pattern.findall(httpx.get(self.metrics_url, timeout=5).text))

        what = f"pool {pool} has {workers} routable workers"
        wait_until_sync(lambda: routable() >= workers, timeout_s, what)


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    names = ["ok1", "ok2", "once500a", "once500b", "ok4", "die", "slow", "err500", "hang", "reject"]
    ports = {name: free_port() for name in names}
    down = _url(free_port())  # nothing listens here
    fake = start_fake_workers({ports[n]: mode for n, mode in zip(names, MODES, strict=True)})
    gateway: Proc | None = None
    try:
        w = {n: _url(p) for n, p in ports.items()}
        w["down"] = down
        # Quick checks, but patient ones: on a loaded machine a health answer may take a while, and
        # a worker wrongly marked down would make routing-dependent tests flaky.
        fast = {"health": {"interval_s": 0.5, "timeout_s": 3.0, "failures_to_down": 3}}
        pools = [
            {"name": "ok", "models": ["m-ok"], "workers": [w["ok1"], w["ok2"]], **fast},
            {
                "name": "retry",
                "models": ["m-retry"],
                "workers": [w["once500a"], w["once500b"]],
                "breaker": {"failure_threshold": 100},
                **fast,
            },
            {"name": "down", "models": ["m-down"], "workers": [down, w["ok4"]], **fast},
            {"name": "die", "models": ["m-die"], "workers": [w["die"]], **fast},
            {"name": "slow", "models": ["m-slow"], "workers": [w["slow"]], **fast},
            {"name": "all500", "models": ["m-500"], "workers": [w["err500"]], "retry_attempts": 1, **fast},
            {"name": "nothing", "models": ["m-none"], "workers": [down], **fast},
            {"name": "reject", "models": ["m-reject"], "workers": [w["reject"]], **fast},
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
        folder = tmp_path_factory.mktemp("gw")
        # A deterministic policy: the same prompt prefix always reaches the same worker, so tests
        # that expect cached_tokens or a retry on "the other" worker do not depend on load.
        (folder / "policy.yaml").write_text("policy: consistent_hash\n")
        config = write_gateway_config(
            folder / "gateway.yaml",
            pools,
            tenants,
            limits={"max_body_bytes": 65536},
            policy_file="policy.yaml",
        )
        port, metrics_port = free_port(), free_port()
        gateway = start_gateway(config, port, metrics_port)
        yield Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", w, gateway, fake)
    finally:
        if gateway is not None:
            gateway.stop()
        fake.stop()


@pytest.fixture()
def gateway_log(stack: Stack) -> Path:
    return stack.gateway.log_path


@pytest.fixture
def processes() -> Iterator[list[Proc]]:
    """Processes a test starts one by one (a broker's, a fake API server's, gateways...): each is
    stopped by PID at the test's end, the last started first."""
    procs: list[Proc] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()
