"""The emulated worker (a real process on loopback) answers as vLLM's OpenAI-compatible server
where an SDK sweep found it did not: Responses cut at `max_output_tokens`, the Responses
`include` values, a streamed retrieve of a stored response, and stop sequences on chat,
completions and Anthropic Messages."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "emu-parity"
TOOLS: Any = [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]


def test_a_response_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model=MODEL, input="tell me more", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and len(cut.output_text) == 5
    stored = client.responses.retrieve(cut.id)
    assert stored.status == "incomplete" and stored.incomplete_details is not None
    events = list(client.responses.create(model=MODEL, input="stream it", max_output_tokens=3, stream=True))
    first: Any = events[0]
    assert first.response.status == "in_progress" and first.response.incomplete_details is None
    # vLLM ends the stream with `response.completed` whatever the final status.
    last: Any = events[-1]
    assert last.type == "response.completed" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    # A tool call ends by itself: complete.
    call = client.responses.create(model=MODEL, input="look it up", tools=TOOLS)
    assert call.output[0].type == "function_call"
    assert call.status == "completed" and call.incomplete_details is None


def test_include_takes_vllms_values_and_refuses_others(client: openai.OpenAI, base_url: str) -> None:
    every: Any = [
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
    ]
    ok = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, include=every)
    assert len(ok.output_text) == 2
    for bad in (["message.output_text"], ["file_search_call.results", "web_search_call.results"], "x"):
        resp = httpx.post(
            f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", "include": bad}, timeout=5
        )
        assert resp.status_code == 400, bad
        err = resp.json()["error"]
        # vLLM's answer to a body its pydantic model refuses: FastAPI's validation error as a 400.
        assert err["type"] == "Bad Request" and err["param"] is None and err["code"] == 400
        assert "validation error" in err["message"] and "include" in err["message"]
    refused = httpx.post(
        f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", "include": ["nope"]}, timeout=5
    ).json()["error"]["message"]
    assert "Input should be 'code_interpreter_call.outputs'" in refused
    assert "'message.output_text.logprobs' or 'reasoning.encrypted_content'" in refused


def test_a_streamed_retrieve_of_a_stored_response_is_cut_as_vllm_cuts_it(
    client: openai.OpenAI, base_url: str
) -> None:
    kept = client.responses.create(model=MODEL, input="keep me", max_output_tokens=2)
    url = f"{base_url}/v1/responses/{kept.id}"
    # vLLM replays events only of background streams: for this one its replay fails once the
    # 200 and the event-stream headers are out, and the connection is closed mid-body.
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        with pytest.raises(httpx.RemoteProtocolError):
            resp.read()
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": "0"}, timeout=10) as resp:
        assert resp.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            resp.read()
    # Not streamed, or unknown: as before.
    assert httpx.get(url, params={"stream": "false"}, timeout=5).json()["id"] == kept.id
    missing = httpx.get(f"{base_url}/v1/responses/resp_nope", params={"stream": "true"}, timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
    for params in ({"stream": "maybe"}, {"stream": "true", "starting_after": "x"}):
        bad = httpx.get(url, params=params, timeout=5)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request", params
    # The server is fine afterwards.
    assert client.responses.retrieve(kept.id).id == kept.id


def _stop_in(text: str) -> tuple[str, int]:
    """A stop string taken from the middle of `text`, and where it first occurs."""
    stop = text[12:16]
    return stop, text.find(stop)


def test_chat_stops_at_a_stop_string_streamed_or_not(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "stop somewhere"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
    text = full.choices[0].message.content or ""
    assert len(text) == 40 and full.choices[0].finish_reason == "length"
    stop, at = _stop_in(text)
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, stop=["no such", stop]
    )
    choice: Any = cut.choices[0]
    assert choice.message.content == text[:at] and choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # vLLM names the stop string that matched
    assert cut.usage is not None and cut.usage.completion_tokens == at + len(stop)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stop=stop, stream=True)
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(d or "" for d in deltas) == text[:at] and len(deltas) == at + len(stop)
    last: Any = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    kept = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == text[: at + len(stop)]
    missed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stop="§§")
    assert missed.choices[0].message.content == text and missed.choices[0].finish_reason == "length"
    assert getattr(missed.choices[0], "stop_reason", "absent") is None


def test_completions_stop_at_a_stop_string_streamed_or_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=40)
    text = full.choices[0].text
    stop, at = _stop_in(text)
    cut = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=40, stop=[stop])
    choice: Any = cut.choices[0]
    assert choice.text == text[:at] and choice.finish_reason == "stop" and choice.stop_reason == stop
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="once upon a time", max_tokens=40, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text[:at]
    choices: Any = [c.choices[0] for c in chunks]
    ends = [(c.finish_reason, c.stop_reason) for c in choices]
    assert ends == [(None, None)] * (len(chunks) - 1) + [("stop", stop)]


def test_a_response_stops_at_a_stop_string_completed(client: openai.OpenAI) -> None:
    """vLLM's Responses request takes chat's `stop`: a match ends the answer, which is then
    `completed` (not cut at `max_output_tokens`), streamed or not."""
    ask: Any = {"model": MODEL, "input": "stop here please", "max_output_tokens": 40}
    full = client.responses.create(**ask)
    stop, at = _stop_in(full.output_text)
    extra: Any = {"stop": [stop]}
    cut = client.responses.create(**ask, extra_body=extra)
    assert cut.status == "completed" and cut.incomplete_details is None
    assert cut.output_text == full.output_text[:at]
    assert cut.usage is not None and cut.usage.output_tokens < 40
    events = list(client.responses.create(**ask, extra_body=extra, stream=True))
    deltas: Any = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == full.output_text[:at] and all(deltas)  # no empty delta
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"


def test_finished_requests_are_counted_by_why_they_ended(client: openai.OpenAI, base_url: str) -> None:
    def counted() -> dict[str, float]:
        text = httpx.get(f"{base_url}/metrics").text
        found = re.findall(r'vllm:request_success_total\{[^}]*finished_reason="(\w+)"\} (\S+)', text)
        return {reason: float(value) for reason, value in found}

    before = counted()
    full = client.completions.create(model=MODEL, prompt="count me", max_tokens=30)
    stop, _ = _stop_in(full.choices[0].text)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=30, stop=[stop])
    after = counted()
    assert after["length"] - before["length"] == 1 and after["stop"] - before["stop"] == 1


def test_bad_stop_strings_are_refused(base_url: str) -> None:
    body: Any = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for stop in ("", ["a", ""], [1], {"a": 1}):
        resp = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "stop": stop}, timeout=5)
        assert resp.status_code == 400, stop
    empty = httpx.post(
        f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ""}, timeout=5
    )
    assert empty.json()["error"]["message"] == "stop cannot contain an empty string."


def test_messages_report_the_stop_sequence(base_url: str) -> None:
    messages: Any = [{"role": "user", "content": "stop in the middle"}]
    with anthropic.Anthropic(api_key="x", base_url=base_url, max_retries=0, timeout=20) as client:
        full = client.messages.create(model=MODEL, max_tokens=40, messages=messages)
        text = full.content[0].text if full.content[0].type == "text" else ""
        stop, at = _stop_in(text)
        cut = client.messages.create(
            model=MODEL, max_tokens=40, messages=messages, stop_sequences=["nope", stop]
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].type == "text" and cut.content[0].text == text[:at]
        assert cut.usage.output_tokens == at + len(stop)
        with client.messages.stream(
            model=MODEL, max_tokens=40, messages=messages, stop_sequences=[stop]
        ) as s:
            streamed = s.get_final_message()
        assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
        assert streamed.content[0].type == "text" and streamed.content[0].text == text[:at]
        # A stop string at the very start leaves no text, and vLLM then sends no block at all.
        empty = client.messages.create(
            model=MODEL, max_tokens=40, messages=messages, stop_sequences=[text[:3]]
        )
        assert empty.content == [] and empty.stop_sequence == text[:3]
        with client.messages.stream(
            model=MODEL, max_tokens=40, messages=messages, stop_sequences=[text[:3]]
        ) as s:
            kinds = [e.type for e in s]
        assert kinds == ["message_start", "message_delta", "message_stop"]
        plain = client.messages.create(model=MODEL, max_tokens=40, messages=messages, stop_sequences=["§§"])
        assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None


def test_included_logprobs_come_with_the_output_text(client: openai.OpenAI, base_url: str) -> None:
    plain = client.responses.create(model=MODEL, input="no logprobs", max_output_tokens=3)
    assert plain.top_logprobs is None
    with_lp = client.responses.create(
        model=MODEL,
        input="logprobs",
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert with_lp.top_logprobs == 2
    item: Any = with_lp.output[0]
    part = item.content[0]
    assert len(part.logprobs) == 4 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in part.logprobs)
    events = list(
        client.responses.create(
            model=MODEL,
            input="logprobs",
            max_output_tokens=4,
            include=["message.output_text.logprobs"],
            stream=True,
        )
    )
    deltas: Any = [e for e in events if e.type == "response.output_text.delta"]
    assert [d.logprobs[0].logprob for d in deltas] == [lp.logprob for lp in part.logprobs]
    assert all(len(d.logprobs) == 1 and d.logprobs[0].top_logprobs == [] for d in deltas)
    too_many = httpx.post(
        f"{base_url}/v1/responses",
        json={"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21},
        timeout=5,
    )
    assert too_many.status_code == 400


def test_output_text_logprobs_are_null_unless_included(base_url: str) -> None:
    # vLLM's Responses serving fills `output_text.logprobs` only when `include` asks for them,
    # and leaves it None (null) otherwise, in the object and in the stream's completed response.
    body = {"model": MODEL, "input": "no logprobs here", "max_output_tokens": 3}
    plain = httpx.post(f"{base_url}/v1/responses", json=body, timeout=10).json()
    assert plain["output"][0]["content"][0]["logprobs"] is None
    stored = httpx.get(f"{base_url}/v1/responses/{plain['id']}", timeout=5).json()
    assert stored["output"][0]["content"][0]["logprobs"] is None
    with httpx.stream("POST", f"{base_url}/v1/responses", json={**body, "stream": True}, timeout=10) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    done = [e for e in events if e["type"] in ("response.output_item.done", "response.completed")]
    items = [e["item"] if "item" in e else e["response"]["output"][0] for e in done]
    assert len(items) == 2 and all(item["content"][0]["logprobs"] is None for item in items)
    # An explicit `"top_logprobs": null` samples without logprobs: null too.
    none = httpx.post(
        f"{base_url}/v1/responses",
        json={**body, "include": ["message.output_text.logprobs"], "top_logprobs": None},
        timeout=10,
    ).json()
    assert none["output"][0]["content"][0]["logprobs"] is None
    asked = httpx.post(
        f"{base_url}/v1/responses", json={**body, "include": ["message.output_text.logprobs"]}, timeout=10
    ).json()
    assert len(asked["output"][0]["content"][0]["logprobs"]) == 3


def test_messages_refuse_a_single_stop_sequence_string_as_vllms_validation(base_url: str) -> None:
    # vLLM's AnthropicMessagesRequest has `stop_sequences: list[str] | None`: pydantic refuses a
    # string before the route runs, and vLLM's validation handler answers in the OpenAI envelope.
    user = [{"role": "user", "content": "x"}]
    body = {"model": MODEL, "max_tokens": 2, "messages": user}
    for bad, kind in (("END", "list_type"), (["END", 5], "string_type")):
        resp = httpx.post(f"{base_url}/v1/messages", json={**body, "stop_sequences": bad}, timeout=5)
        assert resp.status_code == 400, bad
        err = resp.json()["error"]
        assert err["type"] == "Bad Request" and err["param"] is None and err["code"] == 400
        assert err["message"].startswith("1 validation error:") and kind in err["message"]
        assert "'stop_sequences'" in err["message"]
    # count_tokens' request model has neither field: they are ignored there.
    counted = httpx.post(
        f"{base_url}/v1/messages/count_tokens",
        json={"model": MODEL, "messages": user, "stop_sequences": "END", "max_tokens": 0},
        timeout=5,
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    listed = httpx.post(f"{base_url}/v1/messages", json={**body, "stop_sequences": ["END"]}, timeout=5)
    assert listed.status_code == 200 and listed.json()["usage"]["output_tokens"] == 2


WEATHER: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def test_stop_strings_cut_tool_call_text_before_it_is_parsed(client: openai.OpenAI, base_url: str) -> None:
    # vLLM's detokenizer applies stop strings to the generated text, and the tool parser reads
    # what is left: a named tool choice gets the cut arguments (finish_reason is the output's,
    # "stop"); auto parsing finds no complete call in it and answers the text.
    messages: Any = [{"role": "user", "content": "weather?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, tool_choice=NAMED)
    calls = whole.choices[0].message.tool_calls or []
    assert calls[0].function.arguments == '{"city":"example city"}'
    untouched = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, tool_choice=NAMED, stop=["§"]
    )
    assert (untouched.choices[0].message.tool_calls or [])[0].function.arguments == '{"city":"example city"}'
    named = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, tool_choice=NAMED, stop=["example"]
    )
    choice: Any = named.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == "example"
    assert choice.message.tool_calls[0].function.arguments == '{"city":"'
    assert named.usage is not None and named.usage.completion_tokens == len('{"city":"example')
    kept = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, tool_choice=NAMED, stop=["example"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert (kept.choices[0].message.tool_calls or [])[0].function.arguments == '{"city":"example'
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=WEATHER, tool_choice=NAMED, stop=["example"], stream=True
        )
    )
    deltas: Any = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    args = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    last: Any = chunks[-1].choices[0]
    assert args == '{"city":"' and last.finish_reason == "stop" and last.stop_reason == "example"
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, stop=["example"])
    said: Any = auto.choices[0]
    assert not said.message.tool_calls and said.message.content == '{"city":"'
    assert said.finish_reason == "stop" and said.stop_reason == "example"
    # Responses: a named call keeps its cut arguments; the response is completed (not capped).
    flat: Any = [{"type": "function", "name": "get_weather", **WEATHER[0]["function"]}]
    resp = client.responses.create(
        model=MODEL, input="weather?", tools=flat, tool_choice={"type": "function", "name": "get_weather"},
        extra_body={"stop": ["example"]},
    )  # fmt: skip
    item: Any = resp.output[0]
    assert item.type == "function_call" and item.arguments == '{"city":"' and resp.status == "completed"
    text = client.responses.create(
        model=MODEL, input="weather?", tools=flat, extra_body={"stop": ["example"]}
    )
    assert text.output[0].type == "message" and text.output_text == '{"city":"'
    # Messages: vLLM turns a named call's arguments into `input` with json.loads, which fails on
    # the cut text (its 500, Anthropic-shaped); auto parsing answers the text.
    anthropic_tools = [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]
    body = {"model": MODEL, "max_tokens": 50, "messages": messages, "tools": anthropic_tools,
            "stop_sequences": ["example"]}  # fmt: skip
    broken = httpx.post(
        f"{base_url}/v1/messages",
        json={**body, "tool_choice": {"type": "tool", "name": "get_weather"}},
        timeout=10,
    )
    assert broken.status_code == 500 and broken.json()["error"]["type"] == "internal_error"
    plain = httpx.post(f"{base_url}/v1/messages", json=body, timeout=10).json()
    assert plain["content"] == [{"type": "text", "text": '{"city":"'}]
    assert plain["stop_reason"] == "stop_sequence" and plain["stop_sequence"] == "example"
