"""The decision log (`gateway/decision_log.py`): off by default, one line per routed request with
the policy's view and the worker's reported cached tokens, never content, bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.config import ConfigError, parse_config
from gateway.decision_log import DecisionLog
from policies import make_policy
from policies.base import RouteDecision, RouteRequest, WorkerId, WorkerView
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.processes import running_emulator

SECRET = b"k"
PROMPT = "the shared system prompt of a decision log test " * 40


def _config(worker: str, log: Path | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pools": [{"name": "p", "models": ["emulated-llama"], "workers": [worker]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
    }
    if log is not None:
        config["decision_log"] = {"path": str(log)}
    return config


def test_it_is_off_by_default() -> None:
    assert parse_config(_config("http://127.0.0.1:9", None)).decision_log.path is None


@pytest.mark.e2e
async def test_each_request_is_logged_with_its_view_and_cached_tokens(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    with running_emulator("--time-scale", "50") as base:
        async with gateway_in_process(_config(base, log), make_policy("cost"), secret=SECRET) as gw:
            for i, stream in enumerate((False, True)):
                body = {
                    "model": "emulated-llama",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 2,
                    "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None,
                }
                headers = {"authorization": "Bearer sk", "x-request-id": f"req-{i}"}
                resp = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 200
    text = log.read_text()
    assert "shared system prompt" not in text
    first, second = (orjson.loads(line) for line in text.splitlines())
    assert (first["client_request_id"], second["client_request_id"]) == ("req-0", "req-1")
    assert first["namespace"] == second["namespace"] == "tenant:t"
    assert first["n_blocks"] > 0 and first["status"] == 200
    decision = second["decisions"][0]
    assert decision["worker"] == base and decision["reason"] == "hit"
    assert decision["predicted_cached_tokens"] > 0
    (candidate,) = decision["candidates"]
    assert candidate["worker"] == base and candidate["predicted_cached_tokens"] > 0
    assert {"in_flight", "prefill_tokens", "waiting", "running"} <= candidate.keys()
    assert second["cached_tokens"] > 0 and second["ttft_ms"] is not None


def test_the_log_stops_at_max_records(tmp_path: Path) -> None:
    log = DecisionLog(str(tmp_path / "d.jsonl"), max_records=2)
    req = RouteRequest("r", "p", "t", "tenant:t", (), 10, 16)
    view = WorkerView(WorkerId("w"))
    for i in range(5):
        log.decided(f"r{i}", req, RouteDecision(WorkerId("w"), 0.0, "miss"), [view], object(), float(i))
        log.finished(f"r{i}", None, req, status=200, prompt_tokens=10, cached_tokens=0, ttft_s=0.01)
    log.close()
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 2
    assert log.dropped == 3


def test_each_candidate_carries_its_prefill_backlogs_age(tmp_path: Path) -> None:
    log = DecisionLog(str(tmp_path / "d.jsonl"), max_records=2)
    req = RouteRequest("r", "p", "t", "tenant:t", (), 10, 16)
    busy = WorkerView(
        WorkerId("a"), in_flight_requests=1, in_flight_prefill_tokens=900, prefill_started_s=2.0
    )
    idle = WorkerView(WorkerId("b"))
    log.decided("r", req, RouteDecision(WorkerId("b"), 0.0, "miss"), [busy, idle], object(), 3.25)
    log.finished("r", None, req, status=200, prompt_tokens=10, cached_tokens=0, ttft_s=0.01)
    log.close()
    (line,) = (tmp_path / "d.jsonl").read_text().splitlines()
    ages = {c["worker"]: c["prefill_age_s"] for c in orjson.loads(line)["decisions"][0]["candidates"]}
    assert ages == {"a": 1.25, "b": None}


def test_a_path_that_cannot_be_opened_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"decision_log\.path"):
        DecisionLog(str(tmp_path / "no-such-dir" / "d.jsonl"), max_records=2)


async def _pd_worker(prefill: bool) -> tuple[web.AppRunner, str]:
    """A vLLM worker of a P/D pool: the prefill one returns `kv_transfer_params`."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        usage = {"prompt_tokens": 300, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        answer: dict[str, Any] = {"choices": [], "usage": usage}
        if prefill:
            answer["kv_transfer_params"] = {"remote_engine_id": "e", "remote_block_ids": [1]}
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}"


async def test_a_pd_pool_logs_each_leg_with_its_role(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    (p_runner, p_url), (d_runner, d_url) = await _pd_worker(True), await _pd_worker(False)
    config = _config("", log)
    pool = config["pools"][0]
    del pool["workers"]
    pool.update(prefill_workers=[p_url], decode_workers=[d_url], pd={"conditional": False})
    try:
        async with gateway_in_process(config, make_policy("cost"), secret=SECRET) as gw:
            for n in (1, 2):  # two choices cannot be split: the decode worker serves it alone
                body = {"model": "emulated-llama", "messages": [{"role": "user", "content": PROMPT}], "n": n}
                resp = await gw.client.post(
                    "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"}
                )
                assert resp.status_code == 200
    finally:
        await p_runner.cleanup()
        await d_runner.cleanup()
    split, alone = (orjson.loads(line) for line in log.read_text().splitlines())
    prefill, decode = split["decisions"]
    assert (prefill["role"], prefill["worker"]) == ("prefill", p_url)
    assert prefill["reason"] in ("hit", "miss") and "transfer_s" not in prefill
    assert (decode["role"], decode["worker"], decode["reason"]) == ("decode", d_url, "pd_split")
    assert decode["transfer_tokens"] > 0 and decode["transfer_s"] > 0
    assert decode["candidates"][0]["worker"] == d_url
    assert split["status"] == 200 and split["cached_tokens"] == 0
    (only,) = alone["decisions"]
    assert (only["role"], only["worker"], only["reason"]) == ("alone", d_url, "pd_alone_unsplittable")
