"""What the suite reads from the running stack: a process's resident memory, the connections a
server holds, the gateway's metrics (from its own listener), its JSON access lines, and the admin
API's status."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.abuse.stack import KEY_ADMIN, Stack

_HELD_STATES = ("01", "08")  # ESTABLISHED; CLOSE_WAIT (the client closed, the server not yet)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def rss_bytes(pid: int) -> int:
    """The process's resident set size now (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def held_connections(port: int, client: str) -> int:
    """Connections from the IPv4 address `client` accepted on 127.0.0.1:`port` that the server has
    not closed yet (from /proc/net/tcp: the server's side in ESTABLISHED or CLOSE_WAIT)."""
    local, remote = f"{_proc_address('127.0.0.1')}:{port:04X}", f"{_proc_address(client)}:"
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        held += fields[1] == local and fields[2].startswith(remote) and fields[3] in _HELD_STATES
    return held


def _proc_address(address: str) -> str:
    """An IPv4 address as /proc/net/tcp prints it: its bytes in the host's (little-endian) order."""
    return "".join(f"{int(part):02X}" for part in reversed(address.split(".")))


class RssPeak:
    """Samples a process's RSS every `interval_s` while it is entered; `peak` is the highest seen."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.start = rss_bytes(pid)
        self.peak = self.start
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> RssPeak:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.start


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (labels as the server wrote them)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found:
            out[found.group(1) + (found.group(2) or "")] = float(found.group(3))
    return out


async def metrics(session: aiohttp.ClientSession, stack: Stack) -> dict[str, float]:
    async with session.get(stack.metrics_url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return parse_metrics(await resp.text())


def series(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in wanted):
            total += value
    return total


async def routable(session: aiohttp.ClientSession, stack: Stack, pool: str, worker: str) -> bool:
    samples = await metrics(session, stack)
    return series(samples, "kvgate_worker_healthy", pool=pool, worker=worker) == 1.0


async def wait_for(
    check: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.1
) -> tuple[bool, float]:
    """Poll the coroutine function `check` until it returns true or `timeout_s` passes; whether it
    did, and after how long."""
    started = time.monotonic()
    while True:
        if await check():
            return True, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return False, time.monotonic() - started
        await asyncio.sleep(interval_s)


async def admin_status(session: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {KEY_ADMIN}"}
    async with session.get(stack.base_url + "/admin/status", headers=headers) as resp:
        status: dict[str, Any] = orjson.loads(await resp.read())
        return status


class AccessLog:
    """The gateway's log file, read incrementally: the access lines of requests the client named
    (x-request-id), and the log lines that carry a traceback."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.named: dict[str, dict[str, Any]] = {}
        self.traceback_lines: list[bytes] = []

    def read(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        raw = (self._partial + data).split(b"\n")
        self._partial = raw.pop()
        for line in raw:
            if b"Traceback" in line:
                self.traceback_lines.append(line[:2000])
            if not line.startswith(b"{") or b'"client_request_id":"' not in line:
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if "status" in record:
                self.named[record["client_request_id"]] = record

    def requests(self, client_ids: set[str]) -> dict[str, dict[str, Any]]:
        """Access lines of the requests the client named, by that name."""
        self.read()
        return {cid: self.named[cid] for cid in client_ids if cid in self.named}

    async def wait_requests(self, client_ids: set[str], timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """Wait until every named request has its access line (they are flushed every 0.2 s)."""
        deadline = time.monotonic() + timeout_s
        found = self.requests(client_ids)
        while len(found) < len(client_ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            found = self.requests(client_ids)
        return found

    def tracebacks(self) -> int:
        self.read()
        return len(self.traceback_lines)
