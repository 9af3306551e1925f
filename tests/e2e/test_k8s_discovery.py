"""`kvgate serve` with a pool found through the Kubernetes API: a fake API server process, emulated
vLLM workers as the pods, chat requests through the gateway while pods come, go unready and leave."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx

from tests.e2e.harness import (
    Proc,
    free_port,
    start,
    start_emulator,
    start_gateway,
    tenant,
    wait_http,
    write_gateway_config,
)
from tests.gateway.fake_kube_api import make_pod
from tests.support.wait import wait_until_sync

MODEL = "kvgate-k8s"
TOKEN = "e2e-sa-token"


def _emulator(port: int) -> Proc:
    return start_emulator("--model", MODEL, port=port)[1]


def _prompt_tokens(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def _routable(metrics: str) -> set[str]:
    text = httpx.get(metrics + "/metrics", timeout=5).text
    return set(re.findall(r'kvgate_worker_healthy\{pool="k8s",worker="([^"]+)"\} 1\.0', text))


def _wait_routable(metrics: str, workers: set[str], timeout_s: float = 15.0) -> None:
    wait_until_sync(
        lambda: _routable(metrics) == workers, timeout_s, f"routable workers are {sorted(workers)}"
    )


def _chat(base: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(
        base + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-k8s"}, timeout=30
    )


def test_a_pool_discovered_through_the_api_server_routes_chat_requests(
    tmp_path: Path, processes: list[Proc]
) -> None:
    api_port, a_port, b_port, gw_port, metrics_port = (free_port() for _ in range(5))
    api = start(
        [sys.executable, "-m", "tests.gateway.fake_kube_api", "--port", str(api_port), "--token", TOKEN]
    )
    processes.append(api)
    api_url = f"http://127.0.0.1:{api_port}"
    wait_http(api_url + "/_fake/stats", api)
    processes.extend([_emulator(a_port), _emulator(b_port)])
    httpx.post(api_url + "/_fake/pods", json=make_pod("vllm-a", port=a_port), timeout=5).raise_for_status()
    (tmp_path / "token").write_text(TOKEN)
    k8s = {
        "namespace": "llm",
        "selector": "app=vllm",
        "port": "http",
        "api_server": api_url,
        "token_file": str(tmp_path / "token"),
    }
    pool = {
        "name": "k8s",
        "models": [MODEL],
        "kubernetes": k8s,
        "health": {"interval_s": 0.5, "timeout_s": 3},
    }
    config = write_gateway_config(tmp_path / "gw.yaml", [pool], [tenant("t", "sk-k8s")])
    gateway = start_gateway(config, gw_port, metrics_port)
    processes.append(gateway)
    base = f"http://127.0.0.1:{gw_port}"
    metrics = f"http://127.0.0.1:{metrics_port}"
    a, b = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"

    _wait_routable(metrics, {a})
    assert _chat(base).status_code == 200

    httpx.post(api_url + "/_fake/pods", json=make_pod("vllm-b", port=b_port), timeout=5).raise_for_status()
    _wait_routable(metrics, {a, b})
    assert 'kvgate_discovery_workers{pool="k8s"} 2.0' in httpx.get(metrics + "/metrics", timeout=5).text

    httpx.post(api_url + "/_fake/pods/vllm-a/ready", json={"ready": False}, timeout=5).raise_for_status()
    _wait_routable(metrics, {b})
    served_by_a = _prompt_tokens(a_port)
    for _ in range(3):
        assert _chat(base).status_code == 200
    assert _prompt_tokens(a_port) == served_by_a  # the unready pod got nothing

    httpx.delete(api_url + "/_fake/pods/vllm-b", timeout=5).raise_for_status()
    _wait_routable(metrics, set())
    reply = _chat(base)
    assert reply.status_code == 503 and "error" in reply.json()

    httpx.post(api_url + "/_fake/pods/vllm-a/ready", json={"ready": True}, timeout=5).raise_for_status()
    _wait_routable(metrics, {a})
    assert _chat(base).status_code == 200
    assert "Traceback" not in gateway.output()
