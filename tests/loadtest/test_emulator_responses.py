"""The Responses API of the emulated worker (a real process on loopback) with the `openai` SDK:
plain and streamed responses, stored responses continued with `previous_response_id`, tool calls,
and vLLM's errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

MODEL = "emu-responses"
INSTRUCTIONS = "You answer in one short sentence. " * 12
TOOLS: Any = [
    {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    }
]


def test_plain_response_is_stored_and_continued(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="What is a prefix cache?", max_output_tokens=12
    )
    assert first.id.startswith("resp_") and first.status == "incomplete" and first.object == "response"
    assert len(first.output_text) == 12 and first.output[0].type == "message"
    assert first.usage is not None and first.usage.output_tokens == 12
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.total_tokens == first.usage.input_tokens + 12
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    follow = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input="And why does it help?",
        previous_response_id=first.id,
        max_output_tokens=5,
    )
    assert follow.previous_response_id == first.id and follow.usage is not None
    # The follow-up's prompt starts with the first prompt and its answer: all of it is cached
    # (full blocks, at most prompt - 1 tokens), as in the next turn of a chat.
    assert follow.usage.input_tokens > first.usage.input_tokens + 12
    assert follow.usage.input_tokens_details.cached_tokens == (first.usage.input_tokens + 12 - 1) // 16 * 16


def test_unknown_previous_response_is_vllms_404(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    err: Any = exc.value.body
    assert err["message"] == "Response with id 'resp_missing' not found."
    assert err["type"] == "invalid_request_error" and err["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    unstored = client.responses.create(model=MODEL, input="do not keep", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = client.responses.create(model=MODEL, input="keep", max_output_tokens=2)
    cancel = httpx.post(f"{base_url}/v1/responses/{kept.id}/cancel", timeout=5)
    assert cancel.status_code == 400 and "synchronous" in cancel.json()["error"]["message"]


def test_streamed_response_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, instructions="Be brief.", input="stream this", max_output_tokens=4, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed: Any = events[-1]
    assert completed.response.output_text == deltas and completed.response.usage.output_tokens == 4
    assert client.responses.retrieve(completed.response.id).output_text == deltas


def test_raw_stream_framing(base_url: str) -> None:
    body = {"model": MODEL, "input": "raw", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]
    assert "[DONE]" not in raw


def test_input_items_and_function_calls(client: openai.OpenAI) -> None:
    call = client.responses.create(model=MODEL, input="look something up", tools=TOOLS)
    item: Any = call.output[0]
    assert item.type == "function_call" and item.name == "lookup"
    assert json.loads(item.arguments) == {"q": "example q"}
    items: Any = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "found it"},
    ]
    after = client.responses.create(
        model=MODEL, input=items, tools=TOOLS, previous_response_id=call.id, max_output_tokens=3
    )
    assert after.output[0].type == "message" and len(after.output_text) == 3
    assert after.usage is not None and after.usage.input_tokens_details.cached_tokens > 0
    events = list(client.responses.create(model=MODEL, input="stream a call", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"q": "example q"}
    mixed: Any = [
        {"role": "system", "content": "terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"},
                                                        {"type": "input_image", "image_url": "https://x/y.png"}]},
    ]  # fmt: skip
    seen = client.responses.create(
        model=MODEL, input=mixed, max_output_tokens=2, extra_body={"request_id": "resp_mine"}
    )
    assert seen.id == "resp_mine" and seen.usage is not None and seen.usage.input_tokens > 576


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),  # a web_search tool is taken
        ({"input": "x", "tools": [5]}, "tools[0]"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "instructions": 5}, "instructions"),
    ],
)
def test_bad_requests(base_url: str, body: dict[str, Any], param: str) -> None:
    resp = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body}, timeout=5)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param


def running(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("metric missing")


def test_disconnects_abort_streamed_and_plain_responses(base_url: str) -> None:
    body = {"model": MODEL, "input": "long " * 50, "max_output_tokens": 30000, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
        assert running(base_url) == 1
    wait_until_sync(lambda: running(base_url) == 0, what="aborted stream stopped")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base_url}/v1/responses", json={**body, "stream": False}, timeout=httpx.Timeout(5, read=0.3)
        )
    wait_until_sync(lambda: running(base_url) == 0, what="abandoned response stopped")
