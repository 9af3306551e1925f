"""Two gateway processes sharing one nats-server, one of which finds its workers through the
Kubernetes API (a fake API server process): a prompt gateway A routes to a worker that B has not
discovered yet reaches B before the worker does, waits, and is routed by B to that worker as a
hit once B's discovery adds it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx

from gateway.sync.broker import LocalBroker
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

MODEL = "kvgate-sync-k8s"
KEY = "sk-sync-k8s"
TOKEN = "e2e-sa-token"
HIT = 'kvgate_routing_decisions_total{policy="cost",reason="hit"}'


def _metric(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url + "/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _sync(event: str) -> str:
    return f'kvgate_sync_events_total{{event="{event}"}}'


def _wait_metric(metrics_url: str, name: str, at_least: float, timeout_s: float = 20.0) -> None:
    wait_until_sync(lambda: _metric(metrics_url, name) >= at_least, timeout_s, f"{name} >= {at_least}")


def _routable(metrics_url: str) -> set[str]:
    text = httpx.get(metrics_url + "/metrics", timeout=5).text
    return set(re.findall(r'kvgate_worker_healthy\{pool="p",worker="([^"]+)"\} 1\.0', text))


def _add_pod(api_url: str, name: str, port: int) -> None:
    httpx.post(api_url + "/_fake/pods", json=make_pod(name, port=port), timeout=5).raise_for_status()


def _ask(base: str, system: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}], "max_tokens": 2}
    resp = httpx.post(
        base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    cached: int = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_holdings_that_reach_a_gateway_before_their_worker_are_used_once_it_is_discovered(
    tmp_path: Path, processes: list[Proc]
) -> None:
    broker = LocalBroker(free_port(), tmp_path)
    broker.start()
    try:
        _run(tmp_path, processes, broker)
    finally:
        broker.stop()


def _run(tmp_path: Path, processes: list[Proc], broker: LocalBroker) -> None:
    api_port = free_port()
    api = start(
        [sys.executable, "-m", "tests.gateway.fake_kube_api", "--port", str(api_port), "--token", TOKEN]
    )
    processes.append(api)
    api_url = f"http://127.0.0.1:{api_port}"
    wait_http(api_url + "/_fake/stats", api)
    old_port, new_port = free_port(), free_port()
    old, old_proc = start_emulator("--model", MODEL, port=old_port)
    new, new_proc = start_emulator("--model", MODEL, port=new_port)
    processes.extend([old_proc, new_proc])
    _add_pod(api_url, "vllm-old", old_port)
    (tmp_path / "token").write_text(TOKEN)

    health = {"interval_s": 0.5, "timeout_s": 3}
    sync = {"url": broker.url, "subject_prefix": "kvgate.e2e-discovery", "batch_interval_s": 0.002}
    # A already found the new worker (here: it is the only one A has); B watches the API server.
    a_pool = {"name": "p", "models": [MODEL], "workers": [new], "health": health}
    k8s = {
        "namespace": "llm",
        "selector": "app=vllm",
        "port": "http",
        "api_server": api_url,
        "token_file": str(tmp_path / "token"),
    }
    b_pool = {"name": "p", "models": [MODEL], "kubernetes": k8s, "health": health}
    gateways = []
    for name, pool in (("a", a_pool), ("b", b_pool)):
        config = write_gateway_config(tmp_path / f"{name}.yaml", [pool], [tenant("t", KEY)], sync=sync)
        port, metrics_port = free_port(), free_port()
        processes.append(start_gateway(config, port, metrics_port))
        gateways.append((f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"))
    (a, a_metrics), (b, b_metrics) = gateways
    _wait_metric(a_metrics, "kvgate_sync_peers", 1)
    _wait_metric(b_metrics, "kvgate_sync_peers", 1)
    wait_until_sync(lambda: _routable(b_metrics) == {old}, 15, "B routes to the old worker only")

    system = "Quarterly harbour report, section on tides and the lighthouse rota. " * 12
    assert _ask(a, system) < 64  # new to the worker A sent it to: the new one
    # A's holding (and its outcome) reached B, which has not discovered that worker yet.
    _wait_metric(b_metrics, _sync("parked_holdings"), 1)
    assert _metric(b_metrics, _sync("parked_applied")) == 0

    _add_pod(api_url, "vllm-new", new_port)
    wait_until_sync(lambda: _routable(b_metrics) == {old, new}, 15, "B discovered the new worker")
    _wait_metric(b_metrics, _sync("parked_applied"), 1)
    hits = _metric(b_metrics, HIT)
    # B routes the prompt's next turn to the worker that holds its prefix, knowing it does.
    assert _ask(b, system) >= 512
    assert _metric(b_metrics, HIT) == hits + 1
    unmatched = 'kvgate_policy_events_total{event="peer_outcomes_unmatched",policy="cost"}'
    assert _metric(b_metrics, unmatched) == 0
