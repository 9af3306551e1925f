"""`kvgate serve` as a process: graceful drain, config errors, key hashing."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

from gateway.auth import hash_api_key
from tests.e2e.harness import (
    SECRET,
    free_port,
    start_emulator,
    start_fake_workers,
    start_gateway,
    tenant,
    write_gateway_config,
)
from tests.support.wait import wait_until_sync


def test_sigterm_drains_streams_to_the_deadline_then_exits(tmp_path: Path) -> None:
    slow_port, ok_port, gw_port = free_port(), free_port(), free_port()
    workers = start_fake_workers({slow_port: "slow", ok_port: "ok"})
    gateway = None
    try:
        pools = [
            {"name": "slow", "models": ["m-slow"], "workers": [f"http://127.0.0.1:{slow_port}"]},
            {"name": "ok", "models": ["m-ok"], "workers": [f"http://127.0.0.1:{ok_port}"]},
        ]
        config = write_gateway_config(
            tmp_path / "gw.yaml",
            pools,
            [tenant("t", "sk-t")],
            drain={"shutdown_delay_s": 3, "deadline_s": 4.5},
        )
        gateway = start_gateway(config, gw_port)
        base = f"http://127.0.0.1:{gw_port}"
        auth = {"authorization": "Bearer sk-t"}
        body = {"model": "m-slow", "messages": [{"role": "user", "content": "x"}], "stream": True}
        received: list[bytes] = []
        streaming = threading.Event()

        def consume() -> None:
            with httpx.stream(
                "POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=10
            ) as r:
                for chunk in r.iter_raw():
                    received.append(chunk)
                    streaming.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert streaming.wait(5)
        signalled = time.monotonic()
        gateway.popen.send_signal(signal.SIGTERM)
        # Draining: not ready any more, but still serving during the shutdown delay.
        wait_until_sync(lambda: httpx.get(base + "/readyz", timeout=2).status_code == 503, timeout_s=5)
        ok = {"model": "m-ok", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(base + "/v1/chat/completions", json=ok, headers=auth, timeout=5).status_code == 200
        reader.join(10)
        assert not reader.is_alive()
        ended = time.monotonic() - signalled
        events = [e for e in b"".join(received).split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert b"gateway_shutting_down" in events[-2]
        assert ended > 3  # the stream was kept through the shutdown delay, not cut at the signal
        assert gateway.popen.wait(10) == 0
        assert f"base URL {base}/v1" in gateway.output()
    finally:
        if gateway is not None:
            gateway.stop()
        workers.stop()


def test_the_probes_and_metrics_answer_through_the_drain(tmp_path: Path) -> None:
    """With no shutdown delay the client listener closes at the signal, but the metrics listener,
    where the probes are, answers until the process ends: readiness 503 and liveness 200 while a
    stream is still being drained, and /metrics with it."""
    slow_port, gw_port, metrics_port = free_port(), free_port(), free_port()
    workers = start_fake_workers({slow_port: "slow"})
    gateway = None
    try:
        pools = [{"name": "slow", "models": ["m-slow"], "workers": [f"http://127.0.0.1:{slow_port}"]}]
        config = write_gateway_config(
            tmp_path / "gw.yaml",
            pools,
            [tenant("t", "sk-t")],
            drain={"shutdown_delay_s": 0, "deadline_s": 30},
        )
        gateway = start_gateway(config, gw_port, metrics_port)
        base, probes = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{metrics_port}"
        body = {"model": "m-slow", "messages": [{"role": "user", "content": "x"}], "stream": True}
        streaming, done = threading.Event(), threading.Event()

        def consume() -> None:
            auth = {"authorization": "Bearer sk-t"}
            with httpx.stream(
                "POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=40
            ) as r:
                for _ in r.iter_raw():
                    streaming.set()
            done.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert streaming.wait(5)
        gateway.popen.send_signal(signal.SIGTERM)
        wait_until_sync(lambda: httpx.get(probes + "/readyz", timeout=2).status_code == 503, timeout_s=10)
        assert not done.is_set()  # still draining the stream
        assert httpx.get(probes + "/healthz", timeout=2).status_code == 200
        metrics = httpx.get(probes + "/metrics", timeout=2)
        assert metrics.status_code == 200 and _gauge(metrics.text, "kvgate_worker_in_flight") == 1
        assert not done.is_set()
        reader.join(40)  # the stream ends whole (10 s), well before the deadline
        assert done.is_set() and gateway.popen.wait(10) == 0  # then the process, listeners and all
    finally:
        if gateway is not None:
            gateway.stop()
        workers.stop()


def _gauge(metrics_text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text body (0 when it has none)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def test_sigterm_ends_whole_answers_still_waiting_at_the_deadline_with_a_503(tmp_path: Path) -> None:
    """A non-streamed request still generating at the drain deadline, and one still queued behind
    it, are ended by the gateway itself: a JSON 503 `gateway_shutting_down` with Retry-After (not
    uvicorn's plain-text 500 at its own timeout), the worker stops generating, the gateway logs
    its own abort (no 499, no traceback) and exits 0."""
    worker, emulator = start_emulator()
    gw_port, metrics_port = free_port(), free_port()
    gateway = None
    try:
        pools = [
            {
                "name": "p",
                "models": ["emulated-llama"],
                "workers": [worker],
                "max_in_flight_per_worker": 1,  # the second request waits in the pool's queue
            }
        ]
        config = write_gateway_config(
            tmp_path / "gw.yaml", pools, [tenant("t", "sk-t")], drain={"deadline_s": 1.0}
        )
        gateway = start_gateway(config, gw_port, metrics_port)
        base, metrics = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{metrics_port}/metrics"
        # Far longer than the deadline: the emulated worker decodes 100,000 tokens in real time.
        body = {
            "model": "emulated-llama",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 100_000,
        }
        answers: list[httpx.Response] = []

        def ask() -> None:
            answers.append(
                httpx.post(
                    base + "/v1/chat/completions",
                    json=body,
                    headers={"authorization": "Bearer sk-t"},
                    timeout=60,
                )
            )

        askers = [threading.Thread(target=ask) for _ in range(2)]
        for asker in askers:
            asker.start()

        def one_generating_one_queued() -> bool:
            text = httpx.get(metrics, timeout=2).text
            return _gauge(text, "kvgate_worker_in_flight") == 1 and _gauge(text, "kvgate_queue_depth") == 1

        wait_until_sync(one_generating_one_queued, timeout_s=10)
        gateway.popen.send_signal(signal.SIGTERM)
        for asker in askers:
            asker.join(30)
            assert not asker.is_alive()
        assert len(answers) == 2
        for answer in answers:
            assert answer.status_code == 503
            assert answer.headers["content-type"] == "application/json"
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "gateway_shutting_down"
        assert gateway.popen.wait(30) == 0
        output = gateway.output()
        assert "Traceback" not in output and "CancelledError" not in output
        logged = [orjson.loads(line) for line in output.splitlines() if '"logger":"kvgate.access"' in line]
        assert sorted(entry["status"] for entry in logged) == [503, 503]
        assert all(entry["error"] == "gateway_shutting_down" for entry in logged)

        # The worker's request was closed with the gateway's connection: it stops generating.
        def worker_idle() -> bool:
            return _gauge(httpx.get(worker + "/metrics", timeout=2).text, "vllm:num_requests_running") == 0

        wait_until_sync(worker_idle, timeout_s=10)
    finally:
        if gateway is not None:
            gateway.stop()
        emulator.stop()


def test_bad_config_fails_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "pools:\n  - name: p\n    models: [m]\n    max_in_flight_per_worker: -1\n    colour: red\n"
        "tenants: []\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "pools.0.max_in_flight_per_worker" in proc.stderr
    assert "pools.0.colour" in proc.stderr and "tenants" in proc.stderr


def test_hash_key_prints_the_config_form(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--hash-key", "--secret-file", str(secret_file)],
        input="sk-abc\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == hash_api_key(SECRET, "sk-abc")
