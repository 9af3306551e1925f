"""Render-mode keys and KV events from an emulated vLLM worker, through a real gateway."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai

from tests.e2e.harness import free_port, start_emulator, start_gateway, tenant, write_gateway_config
from tests.support.wait import wait_until_sync


def _counter(text: str, name: str) -> float:
    match = re.search(rf'kvgate_policy_events_total{{event="{re.escape(name)}",policy="cost"}} (\S+)', text)
    return float(match.group(1)) if match else -1.0


def _metrics(metrics_url: str) -> str:
    return httpx.get(metrics_url + "/metrics", timeout=5).text


def test_render_mode_and_kv_events_feed_the_policy(tmp_path: Path) -> None:
    zmq_port, gw_port, metrics_port = free_port(), free_port(), free_port()
    worker_url, worker = start_emulator("--model", "m", "--kv-events-endpoint", f"tcp://127.0.0.1:{zmq_port}")
    gateway = None
    try:
        (tmp_path / "policy.yaml").write_text("policy: cost\nprecise_namespace: public\n")
        pool = {
            "name": "p",
            "models": ["m"],
            "workers": [worker_url],
            "normalizer": {"mode": "render"},
            "kv_events_endpoint": f"tcp://{{host}}:{zmq_port}",
        }
        config = write_gateway_config(
            tmp_path / "gw.yaml", [pool], [tenant("t", "sk-t", isolation="public")], policy_file="policy.yaml"
        )
        gateway = start_gateway(config, gw_port, metrics_port)
        base = f"http://127.0.0.1:{gw_port}"
        metrics_url = f"http://127.0.0.1:{metrics_port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-t", max_retries=0, timeout=20)
        messages = [{"role": "system", "content": "abc " * 100}, {"role": "user", "content": "q"}]
        cached = []
        for _ in range(2):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            # The answer's blocks reach the policy as KV events before the next request is routed.
            wait_until_sync(
                lambda: _counter(_metrics(metrics_url), "kv_events_applied") >= 1, what="events applied"
            )
        assert cached[1] is not None and cached[1] >= 400
        text = _metrics(metrics_url)
        assert _counter(text, "kv_events_applied") >= 1
        assert _counter(text, "kv_event_orphans:p") == 0
        assert 'kvgate_routing_decisions_total{policy="cost",reason="hit"}' in text
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
