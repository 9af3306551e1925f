"""A gateway run from a checkout (`--gateway-root`), for benchmarks that compare two commits.

The benchmark's own code is this tree's; the gateway under test is the checkout's, started with
the checkout's CLI (its key hashing included, so the tenant's key matches whatever that commit
does). One tenant whose key is `key`, the pools and limits given, and a policy file naming
`policy`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
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


async def post_chat(
    port: int, key: str, body: bytes, *, small_window: bool = False, close: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """POST `body` to the gateway's chat completions on 127.0.0.1:`port` as the tenant of `key`;
    the connection (reader, writer) and the answer's status, once its status line has come. With
    `small_window` the socket's receive buffer is 64 KiB, so the kernel takes little of an answer
    the client does not read."""
    sock = socket.socket()
    if small_window:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Type: application/json\r\n"
        + (b"Connection: close\r\n" if close else b"")
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    return reader, writer, status


async def read_worker_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """For a raw-socket worker: read one request. A health check (`GET`) is answered 200 here
    (False); a POST's body is read (True), for the caller to answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET"):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        return False
    length = next(
        int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)
    return True
