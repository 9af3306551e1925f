"""Kubernetes discovery followed against the fake API server: a `Discovery` over a
`PodWatcher` with what it reported, for the discovery tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.discovery import Discovery, WorkerSetChange
from gateway.k8s.config import KubernetesDiscoveryConfig
from gateway.k8s.source import PodWatcher
from tests.gateway.fake_kube_api import FakeKubeApi
from tests.support.wait import wait_until


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@dataclass
class Followed:
    """A running discovery over a `PodWatcher`, with what it reported."""

    discovery: Discovery
    watcher: PodWatcher
    changes: list[WorkerSetChange] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    resyncs: int = 0

    @property
    def current(self) -> frozenset[str]:
        return self.discovery.current

    async def routed(self, *ports: int) -> None:
        """Wait until exactly these ports are routed (the timeout only guards against a hang)."""
        await wait_until(lambda: self.current == {url(p) for p in ports})


@contextlib.asynccontextmanager
async def follow(
    fake: FakeKubeApi | None,
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    **watcher: Any,
) -> AsyncIterator[Followed]:
    token = tmp_path / "token"
    if not token.exists():
        token.write_text((fake.token if fake else None) or "unused")
    settings: dict[str, Any] = {
        "namespace": "llm",
        "selector": "app=vllm",
        "port": "http",
        "token_file": str(token),
        **({"api_server": fake.url} if fake is not None else {}),
        **(config or {}),
    }
    source = PodWatcher(
        KubernetesDiscoveryConfig(**settings), **{"backoff_initial_s": 0.02, "backoff_max_s": 0.1, **watcher}
    )
    followed: Followed

    def resynced() -> None:
        followed.resyncs += 1

    discovery = Discovery(source, on_error=lambda reason: followed.errors.append(reason), on_resync=resynced)
    followed = Followed(discovery, source)
    await discovery.start(followed.changes.append)
    try:
        yield followed
    finally:
        await discovery.stop()
