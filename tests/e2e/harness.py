"""What the e2e modules import: the shared process and gateway-config machinery of
`tests.support`, and the scripted fake workers (`tests.e2e.fake_worker`) started as one process."""

from __future__ import annotations

import sys

from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.processes import Proc, free_port, start, start_emulator, start_gateway, wait_http

__all__ = [
    "SECRET",
    "Proc",
    "free_port",
    "start",
    "start_emulator",
    "start_fake_workers",
    "start_gateway",
    "tenant",
    "wait_http",
    "write_gateway_config",
]


def start_fake_workers(modes: dict[int, str]) -> Proc:
    """One fake-worker process listening on every port of `modes`, each with its behaviour."""
    argv = [sys.executable, "-m", "tests.e2e.fake_worker"]
    for port, mode in modes.items():
        argv += ["--listen", f"{port}:{mode}"]
    proc = start(argv)
    try:
        for port in modes:
            wait_http(f"http://127.0.0.1:{port}/health", proc)
    except BaseException:
        proc.stop()
        raise
    return proc
