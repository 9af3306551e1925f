"""Emulator route-family pieces without a process: request conversion (Responses, Anthropic
Messages), cache breakpoints, the response store, pooling vectors and encodings, logprobs, and
multipart forms."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from loadtest.emulator.chat_template import IMAGE_TOKENS, image_placeholder, render_chat
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.logprobs import LogprobWriter, chat_logprobs, completion_logprobs
from loadtest.emulator.messages_api import parse_messages
from loadtest.emulator.output import AnswerWriter
from loadtest.emulator.pooling import Pooler, encode_vector
from loadtest.emulator.protocol import parse_chat, parse_completions
from loadtest.emulator.responses_api import ResponseStore, StoredResponse, input_messages, parse_responses
from loadtest.emulator.routes_audio import duration_s, parse_form
from loadtest.engine.tokenizer import ByteTokenizer

CFG = EmulatorConfig(model="m")
TOK = ByteTokenizer()


def test_image_parts_cost_a_fixed_number_of_tokens() -> None:
    a = image_placeholder("https://x/a.png")
    assert len(a) == IMAGE_TOKENS and len(TOK.encode(a)) == IMAGE_TOKENS
    assert a == image_placeholder("https://x/a.png") and a != image_placeholder("https://x/b.png")
    text = render_chat(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}], None
    )
    assert a in text


def test_n_batches_and_logprob_fields() -> None:
    gen = parse_completions({"prompt": ["ab", [1, 2, 3]], "n": 3, "logprobs": 0}, CFG, TOK)
    assert [p.tolist() for p in gen.prompts] == [[97, 98], [1, 2, 3]] and gen.n == 3 and gen.logprobs == 0
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "request_id": "r", "priority": 3},
        CFG,
        TOK,
    )
    assert chat.logprobs == 0 and chat.request_id == "r" and chat.priority == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, CFG, TOK).logprobs is None


def test_logprobs_are_deterministic_and_shaped() -> None:
    answer = AnswerWriter(TOK, 1).text_answer(TOK.encode("prompt"), 6)
    writer = LogprobWriter(TOK, 1)
    entries = writer.for_answer(answer, 4)
    assert entries == LogprobWriter(TOK, 1).for_answer(answer, 4)
    assert entries != LogprobWriter(TOK, 2).for_answer(answer, 4)
    assert all(e.top[0] == (e.token, e.logprob) and len(e.top) == 4 for e in entries)
    assert all(e.logprob <= 0 and all(lp < e.logprob for _t, lp in e.top[1:]) for e in entries)
    chat = chat_logprobs(entries, 2)["content"]
    assert (
        len(chat) == 6
        and len(chat[0]["top_logprobs"]) == 2
        and chat[0]["bytes"] == list(chat[0]["token"].encode())
    )
    assert chat_logprobs(entries, 0)["content"][0]["top_logprobs"] == []
    comp = completion_logprobs(entries[2:])
    assert comp["text_offset"] == [2, 3, 4, 5] and comp["tokens"] == [e.token for e in entries[2:]]


def test_pooler_vectors_and_encodings() -> None:
    pooler = Pooler(seed=0)
    a = pooler.embed(TOK.encode("the cache keeps every prefix"))
    assert a.shape == (1024,) and abs(float(np.linalg.norm(a)) - 1) < 1e-5
    assert np.array_equal(a, Pooler(seed=0).embed(TOK.encode("the cache keeps every prefix")))
    short = pooler.embed(TOK.encode("the cache keeps every prefix"), 32)
    assert short.shape == (32,) and abs(float(np.linalg.norm(short)) - 1) < 1e-5
    assert pooler.score(TOK.encode("same"), TOK.encode("same")) == pytest.approx(1.0)
    assert 0 <= pooler.score(TOK.encode("same"), TOK.encode("other words")) < 1
    f32 = np.frombuffer(base64.b64decode(str(encode_vector(a, "base64"))), dtype="<f4")
    assert np.array_equal(f32, a.astype("<f4"))
    f16 = np.frombuffer(base64.b64decode(str(encode_vector(a, "base64", "float16"))), dtype="<f2")
    assert np.allclose(f16, a, atol=1e-3)
    bf16 = np.frombuffer(base64.b64decode(str(encode_vector(a, "base64", "bfloat16"))), dtype="<u2")
    assert np.allclose((bf16.astype("<u4") << 16).view("<f4"), a, atol=1e-2)
    assert encode_vector(a, "float") == a.astype(np.float64).tolist()


def test_responses_input_items_become_chat_messages() -> None:
    items: Any = [
        {"role": "developer", "content": "be terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"ok": True}},
        {"type": "reasoning", "summary": []},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok":true}'},
    ]
    with pytest.raises(ApiError) as exc:
        input_messages([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    assert exc.value.param == "input[0].content[0]"


def test_response_store_is_bounded_and_continuation_prepends_history() -> None:
    store = ResponseStore(limit=2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, ({"role": "user", "content": str(i)},)))
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    history = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "ANSWER"})
    store.put("resp_prev", StoredResponse({}, history))
    call = parse_responses(
        {"instructions": "sys", "input": "next", "previous_response_id": "resp_prev"}, CFG, TOK, store
    )
    prompt = TOK.decode(call.gen.prompt_ids)
    first = render_chat([{"role": "system", "content": "sys"}, history[0]], None)
    assert prompt.startswith(first + "ANSWER")  # the previous prompt and answer, then the new turn
    assert call.history[-1] == {"role": "user", "content": "next"}
    with pytest.raises(ApiError) as exc:
        parse_responses({"input": "x", "previous_response_id": "resp_0"}, CFG, TOK, store)
    assert exc.value.status == 404 and exc.value.message == "Response with id 'resp_0' not found."


def test_messages_breakpoint_inside_a_message() -> None:
    body: Any = {
        "model": "m",
        "max_tokens": 4,
        "system": "S" * 100,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "A" * 200, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "B" * 50},
                ],
            }
        ],
    }
    call = parse_messages(body, CFG, TOK, 16)
    marked = len("<|system|>\n" + "S" * 100 + "<|end|>\n<|user|>\n" + "A" * 200)
    assert call.cacheable_tokens == marked // 16 * 16
    assert TOK.decode(call.gen.prompt_ids).startswith("<|system|>\n" + "S" * 100)
    body["messages"][0]["content"][0].pop("cache_control")
    assert parse_messages(body, CFG, TOK, 16).cacheable_tokens == 0
    body["tools"] = [
        {"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    ]
    with_tools = parse_messages(body, CFG, TOK, 16)
    text = TOK.decode(with_tools.gen.prompt_ids)
    tools_end = text.index("<|end|>\n", text.index("<|tools|>")) + len("<|end|>\n")
    assert with_tools.cacheable_tokens == tools_end // 16 * 16


def test_messages_conversion_follows_vllm() -> None:
    thinking = {"type": "thinking", "thinking": "hm"}
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
    body: Any = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [thinking, use]},
            {"role": "user", "content": [result]},
        ],
    }
    text = TOK.decode(parse_messages(body, CFG, TOK, 16).gen.prompt_ids)
    assert text == (
        "<|system|>\none two<|end|>\n<|user|>\nq<|end|>\n"
        '<|assistant|>\n<|tool_call|>f {"a":1}<|end|>\n<|tool|>\nt1\nr<|end|>\n<|assistant|>\n'
    )


def test_multipart_form_and_wav_duration() -> None:
    boundary = "XyZ"
    raw = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + b"\x00\x01\xff"
        + f"\r\n--{boundary}--\r\n".encode()
    )
    form = parse_form(f"multipart/form-data; boundary={boundary}", raw)
    assert form.fields == {"model": "m"} and form.file == b"\x00\x01\xff"
    with pytest.raises(ApiError):
        parse_form("application/json", b"{}")
    assert duration_s(b"\x00" * 64_000) == pytest.approx(2.0)  # not a WAV: 16 kHz 16-bit mono assumed
