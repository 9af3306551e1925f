"""Prefill/decode disaggregation between two real emulator processes on loopback, driven the way
routers drive vLLM (two stages, `kv_transfer_params`) and SGLang (`bootstrap_*` on both legs at
once): the answer streams from the decode worker, which reports the prompt as cached, publishes
the received blocks as BlockStored, and the prefill worker keeps the prefix for the next request."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.loadtest.test_emulator import MODEL, metric, running_emulator
from tests.loadtest.test_kv_events import TOPIC, Subscriber
from tests.support.processes import free_port

BS = 16
KV_BYTES_PER_TOKEN = 131072  # llama3-8b-h100


def messages(tag: str, n_chars: int = 600) -> list[dict[str, str]]:
    return [{"role": "system", "content": tag * n_chars}, {"role": "user", "content": "question"}]


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, Any]]:
    boot, pub = free_port(), f"tcp://127.0.0.1:{free_port()}"
    common = ("--time-scale", "20", "--kv-blocks", "4000")
    prefill_args = ("--role", "prefill", "--kv-engine-id", "P0", "--bootstrap-port", str(boot))
    decode_args = ("--role", "decode", "--kv-transfer-timeout-s", "10", "--kv-events-endpoint", pub,
                   "--kv-events-topic", TOPIC)  # fmt: skip
    with running_emulator(*common, *prefill_args) as p, running_emulator(*common, *decode_args) as d:
        sub = Subscriber(pub)
        try:
            yield {"prefill": p, "decode": d, "boot": boot, "events": sub}
        finally:
            sub.close()


def chat(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)


def stream_chat(base: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The streamed text and the final usage of one chat request."""
    text, usage = "", {}
    req = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=req, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
    return text, usage


def prompt_ids(base: str, msgs: list[dict[str, str]]) -> list[int]:
    ids: list[int] = httpx.post(f"{base}/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    return ids


def prefill_leg(base: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
    """What vLLM's proxy sends the prefill server (toy_proxy_server.py)."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    resp = chat(base, {"messages": msgs, "max_tokens": 1, "stream": False, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_vllm_two_stages_stream_from_decode_with_the_prompt_cached(workers: dict[str, Any]) -> None:
    p, d, events = workers["prefill"], workers["decode"], workers["events"]
    msgs = messages("A")
    ids = prompt_ids(d, msgs)
    first = prefill_leg(p, msgs)
    assert first["usage"]["completion_tokens"] == 1
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "P0" and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1" and f":{params['remote_port']}" in p
    assert len(params["remote_block_ids"]) == -(-len(ids) // BS)
    assert isinstance(params["remote_request_id"], str)
    moved_before = metric(d, "vllm:nixl_bytes_transferred_sum")

    text, usage = stream_chat(d, {"messages": msgs, "max_tokens": 12, "kv_transfer_params": params})
    assert len(text) == 12  # one character per token with the byte tokenizer
    assert usage["prompt_tokens"] == len(ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1  # vLLM: prompt - 1
    assert metric(d, "vllm:nixl_bytes_transferred_sum") - moved_before == len(ids) * KV_BYTES_PER_TOKEN

    # The decode worker's cache keeps what it received, and says so in its KV events.
    full = len(ids) // BS
    events.pump(lambda: sum(len(e.hashes) for e in events.stored()) >= full)
    received = [t for e in events.stored() for t in e.token_ids]
    assert received[: full * BS] == ids[: full * BS]

    # The transfer was read once: the same params again find nothing held (vLLM: 500).
    again = chat(d, {"messages": msgs, "max_tokens": 4, "kv_transfer_params": params})
    assert again.status_code == 500
    assert again.json()["error"] == {"message": "Internal server error", "type": "InternalServerError",
                                     "param": None, "code": 500}  # fmt: skip


def test_the_prefill_worker_keeps_the_prefix_for_the_next_request(workers: dict[str, Any]) -> None:
    p = workers["prefill"]
    msgs = messages("B")
    prefill_leg(p, msgs)
    second = prefill_leg(p, msgs)
    prompt = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BS * BS


def test_a_prefill_role_worker_still_serves_plain_requests(workers: dict[str, Any]) -> None:
    resp = chat(workers["prefill"], {"messages": messages("C", 50), "max_tokens": 5})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    assert "kv_transfer_params" not in resp.json()


def test_sglang_legs_sent_together_meet_in_the_room(workers: dict[str, Any]) -> None:
    p, d = workers["prefill"], workers["decode"]
    msgs = messages("D")
    body = {"messages": msgs, "max_tokens": 9, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": workers["boot"], "bootstrap_room": random.getrandbits(63)}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(chat, p, body)
        decode = pool.submit(stream_chat, d, body)
        text, usage = decode.result()
        prefill_answer = prefill.result()
    assert len(text) == 9
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert prefill_answer.status_code == 200
    assert prefill_answer.json()["usage"]["completion_tokens"] == 1  # the prefill leg runs one token
    info = httpx.get(f"{p}/server_info", timeout=5).json()
    assert (
        info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == workers["boot"]
    )
    assert httpx.get(f"{d}/server_info", timeout=5).json()["role"] == "decode"


def test_pd_fields_need_one_sequence(workers: dict[str, Any]) -> None:
    resp = chat(workers["prefill"], {"messages": messages("E", 20), "n": 2,
                                     "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    bad = chat(workers["decode"], {"messages": messages("E", 20), "kv_transfer_params": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    room = chat(
        workers["decode"], {"messages": messages("E", 20), "bootstrap_host": "h", "bootstrap_room": -1}
    )
    assert room.status_code == 400 and room.json()["error"]["param"] == "bootstrap_room"
