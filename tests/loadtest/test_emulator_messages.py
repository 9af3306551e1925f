"""Anthropic Messages on the emulated worker (a real process on loopback), driven by the
`anthropic` SDK: cache usage from the engine's prefix cache, streaming events, tool use, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MODEL = "emu-messages"
SYSTEM: Any = [
    {"type": "text", "text": "You are a careful assistant who cites sources. " * 40},
    {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}},
]


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(api_key="sk-test", base_url=base_url, max_retries=0, timeout=20) as c:
        yield c


def prompt_tokens(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


def test_cache_control_system_block_sent_twice(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "What changed in the report?"}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages).input_tokens
    first = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages)
    assert first.type == "message" and first.role == "assistant" and first.stop_reason == "max_tokens"
    assert first.content[0].type == "text" and len(first.content[0].text) == 8
    assert first.usage.output_tokens == 8 and prompt_tokens(first.usage) == counted
    assert first.usage.cache_read_input_tokens == 0
    marked = len("<|system|>\n") + len(SYSTEM[0]["text"]) + len(SYSTEM[1]["text"])
    assert first.usage.cache_creation_input_tokens == marked // 16 * 16  # the marked prefix, in blocks
    second = client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages)
    assert second.usage.cache_read_input_tokens is not None and second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens == (counted - 1) // 16 * 16
    assert second.usage.cache_creation_input_tokens == 0 and prompt_tokens(second.usage) == counted
    assert second.content[0].text == first.content[0].text  # deterministic


def test_without_cache_control_nothing_is_created(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model=MODEL, max_tokens=2, system="plain system " * 20, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.usage.cache_creation_input_tokens == 0 and r.usage.input_tokens > 200


def test_cache_salt_separates(client: anthropic.Anthropic) -> None:
    kwargs: Any = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "salted " * 30}]}
    a = client.messages.create(**kwargs, extra_body={"cache_salt": "tenant-a"})
    b = client.messages.create(**kwargs, extra_body={"cache_salt": "tenant-b"})
    c = client.messages.create(**kwargs, extra_body={"cache_salt": "tenant-a"})
    reads = [r.usage.cache_read_input_tokens for r in (a, b, c)]
    assert reads[0] == 0 and reads[1] == 0 and reads[2] is not None and reads[2] > 100


def test_streamed_message(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "stream it"}]
    client.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=messages)  # caches it
    with client.messages.stream(model=MODEL, max_tokens=5, system=SYSTEM, messages=messages) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    raw_kinds = [k for k in kinds if k not in ("text",)]  # the SDK adds "text" helper events
    assert raw_kinds[0] == "message_start" and raw_kinds[1] == "content_block_start"
    assert raw_kinds.count("content_block_delta") == 5
    assert raw_kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    assert final.usage.cache_read_input_tokens is not None and final.usage.cache_read_input_tokens > 0
    block = final.content[0]
    assert block.type == "text" and len(block.text) == 5


def test_raw_stream_framing(base_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    frames = [f.split("\n") for f in raw.split("\n\n") if f]
    assert all(e.startswith("event: ") and d.startswith("data: ") for e, d in frames)
    assert [json.loads(d[6:])["type"] for _e, d in frames] == [e[7:] for e, _d in frames]
    start = json.loads(frames[0][1][6:])["message"]
    assert start["content"] == [] and start["stop_reason"] is None and "input_tokens" in start["usage"]


def test_tool_use_and_tool_result(client: anthropic.Anthropic) -> None:
    tools: Any = [
        {
            "name": "get_weather",
            "description": "Weather for a city",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    question: Any = {"role": "user", "content": "Weather in Paris?"}
    r = client.messages.create(
        model=MODEL, max_tokens=50, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )  # fmt: skip
    assert r.stop_reason == "tool_use"
    use: Any = r.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "example city"}
    follow: Any = [
        question,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    after = client.messages.create(model=MODEL, max_tokens=3, tools=tools, messages=follow)
    assert after.stop_reason == "max_tokens" and after.content[0].type == "text"
    with client.messages.stream(model=MODEL, max_tokens=50, tools=tools, messages=[question]) as stream:
        final = stream.get_final_message()
    streamed: Any = final.content[0]
    assert streamed.type == "tool_use" and streamed.input == {"city": "example city"}


def test_image_block_is_accepted(client: anthropic.Anthropic) -> None:
    content: Any = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "text", "text": "describe"},
    ]
    r = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}])
    assert r.usage.input_tokens > 576


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, base_url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    body: Any = missing.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    user = [{"role": "user", "content": "x"}]
    cases: list[tuple[bytes, str]] = [
        (b"{not json", "JSON"),
        (json.dumps({"model": MODEL, "messages": user}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "max_tokens": 2, "messages": []}).encode(), "messages"),
        (
            json.dumps(
                {"model": MODEL, "max_tokens": 2, "messages": [{**user[0], "role": "robot"}]}
            ).encode(),
            "role",
        ),
        (json.dumps({"max_tokens": 2, "messages": user}).encode(), "model"),
    ]
    for raw, needle in cases:
        resp = httpx.post(
            f"{base_url}/v1/messages", content=raw, headers={"content-type": "application/json"}, timeout=5
        )
        assert resp.status_code == 400, raw[:50]
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert needle in err["error"]["message"], err


def test_disconnect_aborts_a_streamed_message(base_url: str) -> None:
    def running() -> float:
        for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("metric missing")

    body = {
        "model": MODEL,
        "max_tokens": 30000,
        "stream": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
        assert running() == 1
    wait_until_sync(lambda: running() == 0, what="aborted stream stopped")
