"""On real processes: one tenant opening many streamed retrieves of its own background response
(`GET /v1/responses/{id}?stream=true`, left open) no longer takes the worker out of rotation for
every tenant. Its retrieves past its share of the worker's bound get 503 `gateway_overloaded`;
the gateway's health checks and scrapes, on a session of their own, keep answering; another
tenant is served. A `HEAD` of a stored response is its `GET`'s head."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.auth import hash_api_key
from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.processes import Proc, free_port, running_emulator, start_gateway
from tests.support.wait import wait_until_sync

ADMIN_KEY = "sk-e2e-admin-0123456789abcdef0123456789"
RETRIEVES = 8  # twice the worker's connections: every one of them, and as many waiting


@dataclass
class Stack:
    base_url: str
    port: int
    gateway: Proc

    def worker(self) -> dict[str, Any]:
        """The one worker's entry of `/admin/status`."""
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        resp = httpx.get(self.base_url + "/admin/status", headers=headers, timeout=10)
        worker: dict[str, Any] = resp.json()["pools"][0]["workers"][0]
        return worker


@contextlib.contextmanager
def running_stack(folder: Path) -> Iterator[Stack]:
    with running_emulator("--model", "m") as worker_url:
        pools = [
            {
                "name": "p",
                "models": ["m"],
                "workers": [worker_url],
                "health": {"interval_s": 0.2, "timeout_s": 0.5},
            }
        ]
        tenants = [tenant("a", "sk-a"), tenant("b", "sk-b")]
        path = write_gateway_config(
            folder / "gateway.yaml",
            pools,
            tenants,
            admin={"api_key_hash": hash_api_key(SECRET, ADMIN_KEY)},
            scrape={"interval_s": 0.2, "timeout_s": 0.5},
            upstream={"max_connections_per_worker": 4},
        )
        port = free_port()
        proc = start_gateway(path, port)
        try:
            yield Stack(f"http://127.0.0.1:{port}", port, proc)
        finally:
            proc.stop()


def _background(stack: Stack) -> str:
    """The id of a long background response of tenant a, from its stream's first event."""
    body = {"model": "m", "input": "story", "max_output_tokens": 30000, "background": True, "stream": True}
    headers = {"authorization": "Bearer sk-a"}
    with httpx.stream("POST", stack.base_url + "/v1/responses", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        got = b""
        for chunk in r.iter_bytes():
            got += chunk
            if b'"id":"' in got:
                break
    rid = got.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    return rid


def _open_retrieve(stack: Stack, rid: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    head = f"GET /v1/responses/{rid}?stream=true HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-a\r\n\r\n"
    conn.sendall(head.encode())
    return conn


def _head_of(conn: socket.socket) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(4096)
        assert chunk, "the gateway closed the connection before an answer's head"
        got += chunk
    return got


@dataclass
class Watch:
    """What polling `/admin/status` saw: scrapes completed (a success resets the result's age,
    a failure counts), and every time the worker was not routable."""

    scrapes: int = 0
    not_routable: int = 0
    errors: tuple[str, ...] = ()
    _age_s: float | None = None
    _failures: int | None = None

    def saw(self, worker: dict[str, Any]) -> None:
        if not (worker["healthy"] and worker["routable"]):
            self.not_routable += 1
        scrape = worker["scrape"]
        age_s, failures = scrape["age_s"], scrape["failures"]
        if self._age_s is not None and age_s is not None and age_s < self._age_s:
            self.scrapes += 1
        if self._failures is not None and failures > self._failures:
            self.scrapes += failures - self._failures
            self.errors += (str(scrape["last_error"]),)
        self._age_s, self._failures = age_s, failures


def test_open_streamed_retrieves_of_one_tenant_leave_the_worker_up(tmp_path: Path) -> None:
    with running_stack(tmp_path) as stack:
        wait_until_sync(lambda: stack.worker()["routable"], what="the worker is routable")
        rid = _background(stack)
        held = [_open_retrieve(stack, rid) for _ in range(RETRIEVES)]
        try:
            watch = Watch()

            def scraped_ten_times() -> bool:
                watch.saw(stack.worker())
                return watch.scrapes >= 10 or watch.not_routable > 0

            # Ten scrape intervals, each of them one health-check interval too.
            wait_until_sync(scraped_ten_times, timeout_s=30, what="ten scrapes of the worker")
            assert watch.not_routable == 0, watch
            assert not any("Timeout" in e for e in watch.errors), watch
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            resp = httpx.post(
                stack.base_url + "/v1/chat/completions",
                json=chat,
                headers={"authorization": "Bearer sk-b"},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            # a alone at the worker: its share is the worker's cap, a quarter of its 4 connections.
            heads = [_head_of(conn) for conn in held]
            served = [h for h in heads if h.startswith(b"HTTP/1.1 200")]
            refused = [h for h in heads if h.startswith(b"HTTP/1.1 503")]
            assert len(served) == 1 and len(refused) == RETRIEVES - 1
            assert all(b"retry-after: 1" in h.lower() for h in refused)
        finally:
            for conn in held:
                conn.close()
        # The places are given back as the streams close: a's next retrieve is served.
        a = {"authorization": "Bearer sk-a"}
        url = f"{stack.base_url}/v1/responses/{rid}"
        wait_until_sync(lambda: httpx.get(url, headers=a, timeout=10).status_code == 200, what="a is served")
        # A HEAD is the GET's head, without a body, as on the gateway's other GET routes.
        head = httpx.head(url, headers=a, timeout=10)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"].startswith("application/json")
        assert httpx.head(stack.base_url + "/v1/models", headers=a, timeout=10).status_code == 200
        httpx.post(url + "/cancel", headers=a, timeout=10)
        assert "Traceback" not in stack.gateway.output()
