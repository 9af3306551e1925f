"""The real `openai` package against a real `kvgate serve` process on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Stack


def _client(stack: Stack, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=10)


def _async_client(stack: Stack, key: str = "sk-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=10)


def worker_log(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_log", timeout=5) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def received(stack: Stack, request_id: str) -> list[dict[str, Any]]:
    """Every worker-side record of one request id, across all fake workers."""
    out = []
    for name, url in stack.workers.items():
        if name == "down":
            continue
        out += [r for r in worker_log(url)["requests"] if r["request_id"] == request_id]
    return out


def test_sync_chat_returns_worker_answer_usage_and_request_id(stack: Stack) -> None:
    raw = _client(stack).chat.completions.with_raw_response.create(
        model="m-ok", messages=[{"role": "user", "content": "hello"}]
    )
    reply = raw.parse()
    assert reply.choices[0].message.content is not None
    assert "hello from the fake worker" in reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    rid = raw.headers["x-request-id"]
    assert rid and len(received(stack, rid)) == 1


def test_inbound_request_id_is_honoured_and_forwarded(stack: Stack) -> None:
    rid = f"client-{uuid.uuid4().hex}"
    raw = _client(stack).chat.completions.with_raw_response.create(
        model="m-ok", messages=[{"role": "user", "content": "x"}], extra_headers={"x-request-id": rid}
    )
    assert raw.headers["x-request-id"] == rid
    assert [r["request_id"] for r in received(stack, rid)] == [rid]


def test_every_field_is_forwarded_and_strict_tenants_get_their_own_salt(stack: Stack) -> None:
    fields: dict[str, Any] = {
        "response_format": {"type": "json_object"},
        "seed": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "n": 1,
        "temperature": 0.3,
        "metadata": {"k": "v"},
        "prompt_cache_key": "conv-1",
    }
    extra = {"top_k": 5, "an_unknown_field": {"nested": [1, 2.5, None]}}
    bodies = {}
    for key in ("sk-acme", "sk-globex", "sk-pub"):
        rid = uuid.uuid4().hex
        _client(stack, key).chat.completions.create(
            model="m-ok",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            extra_headers={"x-request-id": rid},
            extra_body=extra,
            **fields,
        )
        (record,) = received(stack, rid)
        bodies[key] = record["body"]
    for body in bodies.values():
        for name, value in {**fields, **extra}.items():
            assert body[name] == value, name
    assert bodies["sk-acme"]["cache_salt"] != bodies["sk-globex"]["cache_salt"]
    assert len(bodies["sk-acme"]["cache_salt"]) >= 16
    assert "cache_salt" not in bodies["sk-pub"]  # public tenants share worker KV


async def test_async_stream_with_usage_has_choices_list_and_cached_tokens(stack: Stack) -> None:
    client = _async_client(stack)
    messages = [{"role": "system", "content": "S" * 600}, {"role": "user", "content": "stream please"}]
    usages = []
    for _ in range(2):
        text = []
        stream = await client.chat.completions.create(
            model="m-ok", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        last = None
        async for chunk in stream:
            last = chunk
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        assert "hello from the fake worker" in "".join(text)
        assert last is not None and last.choices == [] and last.usage is not None
        usages.append(last.usage)
    details = usages[1].prompt_tokens_details
    assert details is not None and details.cached_tokens is not None and details.cached_tokens > 0


def test_stream_without_include_usage_gets_no_usage_chunk(stack: Stack) -> None:
    rid = uuid.uuid4().hex
    chunks = list(
        _client(stack).chat.completions.create(
            model="m-ok",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"x-request-id": rid},
        )
    )
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    # The gateway asked the worker for usage on the client's behalf (for routing feedback).
    (record,) = received(stack, rid)
    assert record["body"]["stream_options"] == {"include_usage": True}


def test_raw_sse_is_well_formed(stack: Stack) -> None:
    body = {
        "model": "m-ok",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        stack.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer sk-acme"},
        timeout=10,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"]
        raw = b"".join(resp.iter_bytes())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    usage_chunk = json.loads(events[-2][len(b"data: ") :])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 7


def test_completions_plain_and_streamed(stack: Stack) -> None:
    client = _client(stack)
    done = client.completions.create(model="m-ok", prompt="Once upon a time", max_tokens=8)
    assert "fake worker" in done.choices[0].text
    assert done.usage is not None and done.usage.prompt_tokens > 0
    parts = list(client.completions.create(model="m-ok", prompt="Once", stream=True))
    assert "fake worker" in "".join(p.choices[0].text for p in parts if p.choices)


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(stack: Stack, stream: bool) -> None:
    client = _client(stack)
    messages: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    if stream:
        calls: dict[int, dict[str, str]] = {}
        for chunk in client.chat.completions.create(
            model="m-ok", messages=messages, tools=TOOLS, stream=True
        ):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                if tc.function:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        call = calls[0]
    else:
        first = client.chat.completions.create(
            model="m-ok", messages=messages, tools=TOOLS, tool_choice="auto"
        )
        assert first.choices[0].finish_reason == "tool_calls"
        tool_calls = first.choices[0].message.tool_calls
        assert tool_calls is not None
        fn = tool_calls[0].function  # type: ignore[union-attr]
        call = {"id": tool_calls[0].id, "name": fn.name, "arguments": fn.arguments}
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'},
    ]
    second = client.chat.completions.create(model="m-ok", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content


def test_models_lists_every_pool_model(stack: Stack) -> None:
    ids = {m.id for m in _client(stack).models.list()}
    assert {"m-ok", "m-retry", "m-down", "m-slow"} <= ids


def test_metrics_count_requests_routing_and_tokens(stack: Stack) -> None:
    _client(stack).chat.completions.create(model="m-ok", messages=[{"role": "user", "content": "count me"}])
    text = httpx.get(stack.base_url + "/metrics", timeout=5).text
    assert 'kvgate_requests_total{endpoint="chat",model="m-ok",status="200",tenant="acme"}' in text
    assert 'kvgate_routing_decisions_total{policy="least_load",reason="least_load"}' in text
    assert "kvgate_prompt_tokens_total" in text and "kvgate_request_duration_seconds_bucket" in text
    assert "kvgate_time_to_first_token_seconds_count" in text
