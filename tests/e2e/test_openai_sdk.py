"""The real `openai` package against a real `kvgate serve` process on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Stack
from tests.support.wait import wait_until_sync


def _client(stack: Stack, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=10)


def _async_client(stack: Stack, key: str = "sk-acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=10)


def worker_log(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_log", timeout=5) as resp:
        data: dict[str, Any] = json.loads(resp.read())
        return data


def received(stack: Stack, tag: str) -> list[dict[str, Any]]:
    """Every worker-side record of the request whose body's `user` field is `tag`, across all fake
    workers (the worker sees the gateway's own request id, never the client's)."""
    out = []
    for name, url in stack.workers.items():
        if name == "down":
            continue
        out += [r for r in worker_log(url)["requests"] if r["body"].get("user") == tag]
    return out


def test_sync_chat_returns_worker_answer_usage_and_request_id(stack: Stack) -> None:
    tag = uuid.uuid4().hex
    raw = _client(stack).chat.completions.with_raw_response.create(
        model="m-ok", messages=[{"role": "user", "content": "hello"}], user=tag
    )
    reply = raw.parse()
    assert reply.choices[0].message.content is not None
    assert "hello from the fake worker" in reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    rid = raw.headers["x-request-id"]
    (record,) = received(stack, tag)
    assert rid and record["request_id"] == rid  # no client id: the internal one is echoed


def test_inbound_request_id_is_echoed_but_never_forwarded(stack: Stack, gateway_log: Path) -> None:
    rid = f"client-{uuid.uuid4().hex}"
    records = []
    for _ in range(2):  # two requests with the same client id must stay two requests upstream
        tag = uuid.uuid4().hex
        raw = _client(stack).chat.completions.with_raw_response.create(
            model="m-ok",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-request-id": rid},
            user=tag,
        )
        assert raw.headers["x-request-id"] == rid
        records += received(stack, tag)
    internal = [r["request_id"] for r in records]
    assert len(internal) == 2 and len(set(internal)) == 2 and rid not in internal
    # The access log links the client's id to the internal one.
    wait_until_sync(lambda: internal[1] in gateway_log.read_text(), what="the access line is written")
    lines = [json.loads(line) for line in gateway_log.read_text().splitlines() if internal[1] in line]
    assert lines and lines[0]["client_request_id"] == rid


def test_every_field_is_forwarded_and_every_tenant_gets_its_own_salt(stack: Stack) -> None:
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
        tag = uuid.uuid4().hex
        _client(stack, key).chat.completions.create(
            model="m-ok",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            user=tag,
            extra_body={**extra, "cache_salt": "client-chosen-salt"},
            **fields,
        )
        (record,) = received(stack, tag)
        bodies[key] = record["body"]
    for body in bodies.values():
        for name, value in {**fields, **extra}.items():
            assert body[name] == value, name
    salts = {key: body["cache_salt"] for key, body in bodies.items()}
    # The client's salt is always replaced; a public tenant's private tail is salted too (only a
    # prompt wholly inside a promoted public prefix may share worker KV).
    assert len(set(salts.values())) == 3 and "client-chosen-salt" not in salts.values()
    assert all(len(salt) >= 16 for salt in salts.values())


def test_vllm_request_id_is_passed_through_and_priority_is_not(stack: Stack) -> None:
    tag = uuid.uuid4().hex
    _client(stack).chat.completions.create(
        model="m-ok",
        messages=[{"role": "user", "content": "x"}],
        user=tag,
        extra_body={"priority": -2, "request_id": "client-named"},
    )
    (record,) = received(stack, tag)
    # The pool's engines do not schedule by priority (`priority_scheduling` off): the client's
    # value never reaches them.
    assert "priority" not in record["body"] and record["body"]["request_id"] == "client-named"
    assert record["request_id"] != "client-named"  # the engine's id is the gateway's X-Request-Id


@pytest.mark.parametrize("field", ["kv_transfer_params", "rid", "data_parallel_rank", "prompt_embeds"])
def test_engine_internal_fields_are_refused(stack: Stack, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(stack).chat.completions.create(
            model="m-ok", messages=[{"role": "user", "content": "x"}], extra_body={field: {"a": 1}}
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field and field in error["message"]


def test_choices_above_the_limit_are_refused_before_any_worker(stack: Stack) -> None:
    tag = uuid.uuid4().hex
    with pytest.raises(openai.BadRequestError) as info:
        _client(stack).chat.completions.create(
            model="m-ok", messages=[{"role": "user", "content": "x"}], n=129, user=tag
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "n" and error["code"] == "integer_above_max_value"
    with pytest.raises(openai.BadRequestError) as info:
        _client(stack).completions.create(model="m-ok", prompt="x", best_of=0, user=tag)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "best_of"
    assert received(stack, tag) == []
    reply = _client(stack).chat.completions.create(
        model="m-ok", messages=[{"role": "user", "content": "x"}], n=128, user=tag
    )
    assert reply.choices and received(stack, tag)[0]["body"]["n"] == 128


async def test_async_stream_with_usage_has_choices_list_and_cached_tokens(stack: Stack) -> None:
    stack.wait_routable("ok", 2)  # the same prefix must find the same worker both times
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
    tag = uuid.uuid4().hex
    chunks = list(
        _client(stack).chat.completions.create(
            model="m-ok",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            user=tag,
        )
    )
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    # The gateway asked the worker for usage on the client's behalf (for routing feedback).
    (record,) = received(stack, tag)
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


def test_models_lists_the_models_with_a_routable_worker(stack: Stack) -> None:
    ids = {m.id for m in _client(stack).models.list()}
    assert {"m-ok", "m-retry", "m-down", "m-slow"} <= ids
    assert "m-none" not in ids  # its only worker is down
    assert _client(stack).models.retrieve("m-ok").id == "m-ok"
    with pytest.raises(openai.NotFoundError):
        _client(stack).models.retrieve("m-none")


def test_metrics_count_requests_routing_and_tokens(stack: Stack) -> None:
    _client(stack).chat.completions.create(model="m-ok", messages=[{"role": "user", "content": "count me"}])
    text = httpx.get(stack.metrics_url, timeout=5).text
    assert 'kvgate_requests_total{endpoint="chat",model="m-ok",status="200",tenant="acme"}' in text
    assert 'kvgate_routing_decisions_total{policy="consistent_hash",reason=' in text
    assert "kvgate_prompt_tokens_total" in text and "kvgate_request_duration_seconds_bucket" in text
    assert "kvgate_time_to_first_token_seconds_count" in text
