"""The probes on the metrics listener, against a real gateway process: a client port at its
connection cap (`max_client_connections`) closes new connections, yet /healthz and /readyz on the
metrics port still answer, /readyz with 503 once the gateway drains (what the chart's kubelet
probes rely on)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx

from tests.e2e.harness import free_port, start_gateway, tenant, write_gateway_config
from tests.support.wait import wait_until_sync

MAX_CONNECTIONS = 4
WAIT_S = 15.0
HELD_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-a\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
)


def _closed_at_once(port: int) -> bool:
    """A new connection to the client port is closed by the server before it answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.settimeout(WAIT_S)
        try:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
            return conn.recv(1024) == b""
        except ConnectionResetError:
            return True


def test_the_probes_answer_on_the_metrics_port_while_the_client_port_is_full(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text("policy: cost\n")
    config = write_gateway_config(
        tmp_path / "gateway.yaml",
        [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{free_port()}"]}],
        [tenant("a", "sk-a")],
        # Long enough for the test to see the held connections and the drain.
        limits={"max_client_connections": MAX_CONNECTIONS, "body_timeout_s": 300.0},
        drain={"deadline_s": 300.0, "shutdown_delay_s": 300.0},
        policy_file="policy.yaml",
    )
    port, metrics_port = free_port(), free_port()
    proc = start_gateway(config, port, metrics_port)
    held: list[socket.socket] = []
    try:
        # Requests the gateway has taken, waiting on their bodies: an idle connection would give
        # its place to a new one.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
        for conn in held:
            conn.sendall(HELD_REQUEST)
        wait_until_sync(lambda: _closed_at_once(port), WAIT_S, what="the client port is at its cap")

        probes = f"http://127.0.0.1:{metrics_port}"
        assert httpx.get(f"{probes}/healthz", timeout=WAIT_S).status_code == 200
        ready = httpx.get(f"{probes}/readyz", timeout=WAIT_S)
        assert (ready.status_code, ready.json()["status"]) == (200, "ready")

        proc.popen.send_signal(signal.SIGTERM)  # drains; listens on for shutdown_delay_s

        def draining() -> bool:
            return httpx.get(f"{probes}/readyz", timeout=WAIT_S).status_code == 503

        wait_until_sync(draining, WAIT_S, what="/readyz on the metrics port turns 503")
        assert httpx.get(f"{probes}/readyz", timeout=WAIT_S).json()["status"] == "draining"
        assert httpx.get(f"{probes}/healthz", timeout=WAIT_S).status_code == 200
    finally:
        for conn in held:
            conn.close()
        proc.stop(signal.SIGKILL)
