"""`kvgate serve --processes 2` with a decision log: the supervisor starts the file anew once, and
both processes append to it on one timeline, so requests sent one after another have growing
`t_s` whichever process routed them (what `kvgate bench replay` reads)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.harness import metrics_urls, serving_processes
from tests.support.gateway_config import SECRET, tenant, write_gateway_config
from tests.support.processes import running_emulator

KEY = "sk-e2e-decisions"


def _served(metrics_url: str) -> int:
    text = httpx.get(metrics_url, timeout=5).text
    found = re.search(r'kvgate_requests_total\{endpoint="chat",[^}]*status="200"[^}]*\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


@pytest.mark.e2e
def test_the_processes_append_one_decision_log_on_one_timeline(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    log.write_text('{"stale": "a line of an earlier run"}\n')
    with running_emulator("--time-scale", "50") as base:
        config = write_gateway_config(
            tmp_path / "gateway.yaml",
            [{"name": "p", "models": ["emulated-llama"], "workers": [base]}],
            [tenant("t", KEY)],
            decision_log={"path": str(log)},
            scrape={"enabled": False},
        )
        env = {"KVGATE_KEY_SECRET": SECRET.decode()}
        with serving_processes("--config", str(config), env=env) as (base_url, proc):
            sent = 0
            # Fresh connections until each process has routed some (the kernel picks the process).
            while sent < 8 or min(_served(url) for url in set(metrics_urls(proc))) == 0:
                assert sent < 64, "the kernel sent every connection to one process"
                body = {"model": "emulated-llama", "messages": [{"role": "user", "content": f"q{sent}"}]}
                headers = {"authorization": f"Bearer {KEY}", "x-request-id": f"r{sent:03d}"}
                with httpx.Client(timeout=30) as client:
                    resp = client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 200, resp.text
                sent += 1
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert all("stale" not in line for line in lines)  # the supervisor started the file anew
    assert "stale" in (tmp_path / "decisions.jsonl.prev").read_text()  # the last run's, moved aside
    ordered = sorted(lines, key=lambda line: line["client_request_id"])
    assert len(ordered) == sent
    times = [line["decisions"][0]["t_s"] for line in ordered]
    assert times == sorted(times)  # one origin: later requests, later times, in either process
