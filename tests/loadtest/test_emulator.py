"""The emulated worker over HTTP: a real `python -m loadtest.emulator` process on loopback,
driven by the `openai` SDK and raw httpx (SSE shape, metrics, render, tools, errors, abort)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support import processes
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MODEL = "emu-test"
RUNNING = "vllm:num_requests_running"


def running_emulator(*extra: str, model: str = MODEL) -> contextlib.AbstractContextManager[str]:
    """The emulator process serving `model` (yields its base URL; always stopped by PID)."""
    return processes.running_emulator("--model", model, *extra)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_emulator("--time-scale", "20", "--kv-blocks", "4000") as base:
        yield base


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="x", base_url=f"{base_url}/v1", max_retries=0, timeout=20) as c:
        yield c


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def test_chat_sync_usage_and_cache_hit(client: Any) -> None:
    messages = [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "first question"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content is not None and len(first.choices[0].message.content) == 20
    assert first.usage is not None and first.usage.completion_tokens == 20
    # The rendered prompt (template + contents) is one token per byte.
    assert first.usage.prompt_tokens == len(
        "<|system|>\n" + "S" * 300 + "<|end|>\n<|user|>\nfirst question<|end|>\n<|assistant|>\n"
    )
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].message.content == first.choices[0].message.content  # deterministic


def test_next_turn_hits_on_previous_answer(client: Any) -> None:
    turn1 = [{"role": "user", "content": "tell me about caches " * 10}]
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=64)
    answer = r1.choices[0].message.content
    assert r1.usage is not None and answer is not None
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "and more?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4)
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    # Prompt and answer were cached as they were computed (all but the last answer token).
    assert r2.usage.prompt_tokens_details.cached_tokens == (r1.usage.prompt_tokens + 64 - 1) // 16 * 16


def test_cache_salt_separates(client: Any) -> None:
    messages = [{"role": "user", "content": "salted prompt " * 20}]
    a = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": "alice"}
    )
    b = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": "bob"}
    )
    c = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": "alice"}
    )
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (a, b, c)]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 200


def test_chat_streaming_with_usage(client: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert len(content) == 7  # one chunk per generated token
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in content] == [None] * 6 + ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in content).__len__() == 7
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 7 and last.usage.prompt_tokens_details is not None
    assert all(c.usage is None for c in content)


def test_completions_sync_and_stream(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=5)
    assert len(r.choices[0].text) == 5 and r.usage is not None and r.usage.prompt_tokens == 100
    ids = client.completions.create(model=MODEL, prompt=[120] * 100, max_tokens=5)  # token ids, same prompt
    assert ids.usage is not None and ids.usage.prompt_tokens_details is not None
    assert ids.usage.prompt_tokens_details.cached_tokens == 96
    pieces = list(
        client.completions.create(
            model=MODEL, prompt="y" * 50, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [p.choices[0].finish_reason for p in pieces if p.choices] == [None, None, None, "length"]
    assert pieces[-1].choices == [] and pieces[-1].usage is not None and pieces[-1].usage.prompt_tokens == 50


def test_raw_sse_framing(base_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "raw"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    parsed = [json.loads(e[6:]) for e in events[:-1]]
    assert len(parsed) == 3 and all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert "usage" not in parsed[0]  # only with stream_options.include_usage


def test_tool_call_then_text_after_tool_result(client: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
        },
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "days", "unit"],
                },
            },
        },
    ]
    user = {"role": "user", "content": "weather in Paris?"}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[user],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert (
        set(args) == {"city", "days", "unit"} and isinstance(args["days"], int) and args["unit"] == "celsius"
    )
    first = client.chat.completions.create(model=MODEL, messages=[user], tools=tools)
    assert first.choices[0].message.tool_calls[0].function.name == "noop"
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            user,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
        tools=tools,
        max_tokens=5,
    )
    assert follow.choices[0].finish_reason == "length" and follow.choices[0].message.content
    none = client.chat.completions.create(
        model=MODEL, messages=[user], tools=tools, tool_choice="none", max_tokens=3
    )
    assert not none.choices[0].message.tool_calls


def test_streamed_tool_call(client: Any) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], tools=tools, stream=True
        )
    )
    first = chunks[0].choices[0].delta.tool_calls
    assert first is not None and first[0].function is not None and first[0].function.name == "f"
    args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks if c.choices)
    assert json.loads(args) == {"q": "example q"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_errors_are_openai_shaped(client: Any, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (
            json.dumps({"messages": [{"role": 7, "content": "x"}]}).encode(),
            400,
            "messages[0].role",
        ),  # any string
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
            400,
            "messages[0].content[0]",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).encode(),
            400,
            "top_logprobs",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "priority": "high"}).encode(),
            400,
            "priority",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}).encode(),
            400,
            "cache_salt",
        ),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}
            ).encode(),
            400,
            "stream_options",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x" * 70000}], "max_tokens": 10}).encode(),
            400,
            "messages",
        ),
    ]
    for raw, status, param in cases:
        resp = httpx.post(
            f"{base_url}/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=5,
        )
        assert resp.status_code == status, raw[:60]
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    huge = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 10**12}, timeout=5)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_tokens"
    assert "cannot be greater than max_model_len" in huge.json()["error"]["message"]  # vLLM 0.33's
    resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": [1, 999]}, timeout=5)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{base_url}/no/such/path", timeout=5).json()["error"]["type"] == "NotFoundError"


def test_metrics_and_info(base_url: str, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="m" * 64, max_tokens=2)
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    for name in (
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:gpu_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:gpu_prefix_cache_queries_total{",
        "vllm:gpu_prefix_cache_hits_total{",
        "vllm:time_to_first_token_seconds_bucket{",
    ):
        assert name in text, name
    assert 'vllm:cache_config_info{block_size="16"' in text and 'num_gpu_blocks="4000"' in text
    assert metric(base_url, "vllm:prefix_cache_queries_total") >= 64
    info = httpx.get(f"{base_url}/server_info", timeout=5).json()
    assert "model_path" not in info and "tokenizer_path" not in info and info["dp_size"] == 1
    model_info = httpx.get(f"{base_url}/get_model_info", timeout=5).json()
    assert "model_path" not in model_info and model_info["served_model_name"] == MODEL
    models = httpx.get(f"{base_url}/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == MODEL
    load = httpx.get(f"{base_url}/get_load", timeout=5).json()
    assert isinstance(load, list) and "num_tokens" in load[0]


def test_render_endpoints(base_url: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(
        f"{base_url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}, timeout=5
    )
    assert chat.status_code == 200
    ids = chat.json()["token_ids"]
    assert bytes(ids).decode() == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    comp = httpx.post(f"{base_url}/v1/completions/render", json={"prompt": "hello"}, timeout=5).json()
    assert isinstance(comp, list) and comp[0]["token_ids"] == list(b"hello")
    tok = httpx.post(f"{base_url}/tokenize", json={"prompt": "abc"}, timeout=5).json()
    assert tok["count"] == 3 and tok["tokens"] == [97, 98, 99]
    bad = httpx.post(f"{base_url}/v1/chat/completions/render", json={"messages": "hi"}, timeout=5)
    assert bad.status_code == 400


def test_client_disconnect_aborts_and_frees_blocks(base_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "long answer " * 50}],
        "max_tokens": 30000,
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=10) as resp:
        it = resp.iter_bytes()
        next(it)
        assert metric(base_url, "vllm:num_requests_running") == 1
        assert metric(base_url, "vllm:kv_cache_usage_perc") > 0
    wait_until_sync(lambda: metric(base_url, RUNNING) == 0, what="aborted request stopped")
    assert metric(base_url, "vllm:kv_cache_usage_perc") == 0.0


def test_non_streaming_disconnect_aborts(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "z" * 200, "max_tokens": 30000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    wait_until_sync(lambda: metric(base_url, RUNNING) == 0, what="abandoned request stopped")
    assert metric(base_url, "vllm:kv_cache_usage_perc") == 0.0
