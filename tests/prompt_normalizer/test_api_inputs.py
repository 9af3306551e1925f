"""Responses and Anthropic Messages keyed as the chat request the worker renders for them: the same
keys as that chat request, zones from the instructions and from `cache_control` breakpoints,
follow-ups keyed only where the gateway can see them, errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import CanonicalPrompt, KeyIdentity, Zone

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
PUBLIC = public_identity_of(IDENT)
SYSTEM = "You are a careful assistant. " * 12
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _norm(**config: Any) -> Normalizer:
    return Normalizer(NormalizerConfig(**config), b"secret")


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, **extra}


def _immutable_end(prompt: CanonicalPrompt) -> int:
    spans = [z for z in prompt.zones if z.zone is Zone.IMMUTABLE]
    return spans[0].end_token if spans else 0


def test_responses_keys_equal_the_chat_request_the_worker_renders() -> None:
    norm = _norm()
    body = {"instructions": SYSTEM, "input": "What is the weather?"}
    responses = norm.canonicalize("responses", body, IDENT, PUBLIC)
    chat = norm.canonicalize(
        "chat",
        _chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": body["input"]}]),
        IDENT,
        PUBLIC,
    )
    assert responses.block_keys == chat.block_keys and responses.n_tokens == chat.n_tokens
    assert responses.zones == chat.zones and responses.public_block_keys == chat.public_block_keys
    assert responses.canonical_body is None  # forwarded as the client sent it


def test_responses_items_convert_to_messages_tool_calls_and_tool_results() -> None:
    # Canonical JSON is a chat-route switch (it rewrites tool-call arguments); a converted request
    # is keyed as sent, so compare with a chat request keyed as sent too.
    norm = _norm(canonical_json=False)
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21C"},
    ]
    tools = [{"type": "function", "name": "weather", "parameters": TOOL_SCHEMA}]
    responses = norm.canonicalize("responses", {"input": items, "tools": tools}, IDENT)
    chat = norm.canonicalize(
        "chat",
        _chat(
            [
                {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "21C"},
            ],
            tools=[{"type": "function", "function": {"name": "weather", "parameters": TOOL_SCHEMA}}],
        ),
        IDENT,
    )
    assert responses.block_keys == chat.block_keys


def test_a_follow_up_is_keyed_only_up_to_its_instructions() -> None:
    norm = _norm()
    first = norm.canonicalize("responses", {"instructions": SYSTEM, "input": "hello"}, IDENT)
    follow = norm.canonicalize(
        "responses", {"instructions": SYSTEM, "input": "and then?", "previous_response_id": "resp_1"}, IDENT
    )
    assert follow.block_keys and first.block_keys[: len(follow.block_keys)] == follow.block_keys
    assert follow.n_tokens < first.n_tokens
    assert any("previous_response_id" in d for d in follow.diagnostics)
    bare = norm.canonicalize("responses", {"input": "and then?", "previous_response_id": "resp_1"}, IDENT)
    assert bare.n_tokens == 0 and bare.block_keys == ()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "message", "role": "user", "content": [{"text": "x"}]}]}, "input[0].content[0]"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": [{"type": "function_call", "name": 1}]}, "input[0].name"),
        ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            "tools[0].parameters",
        ),
    ],
)
def test_responses_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(NormalizerError) as info:
        _norm().canonicalize("responses", body, IDENT)
    assert info.value.param == param


def _messages(system: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 8,
        "system": system,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def test_messages_keys_equal_the_chat_request_with_the_system_blocks_joined() -> None:
    norm = _norm()
    blocks = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be brief."}]
    messages = norm.canonicalize("messages", _messages(blocks), IDENT)
    chat = norm.canonicalize(
        "chat",
        _chat([{"role": "system", "content": SYSTEM + "Be brief."}, {"role": "user", "content": "hi"}]),
        IDENT,
    )
    assert messages.block_keys == chat.block_keys


def test_claude_codes_inline_system_messages_and_roles_are_keyed_as_vllm_reads_them() -> None:
    # A system message inside `messages` (Claude Code adds one on most turns) is keyed where it
    # stands, `ctx` and `msg` as a user's; neither is refused.
    norm = _norm()
    body = _messages(
        SYSTEM,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "Note: be brief."}]},
            {"role": "ctx", "content": "more context"},
            {"role": "msg", "content": "and a question"},
        ],
    )
    chat = _chat(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "system", "content": "Note: be brief."},
            {"role": "user", "content": "more context"},
            {"role": "user", "content": "and a question"},
        ]
    )
    assert (
        norm.canonicalize("messages", body, IDENT).block_keys
        == norm.canonicalize("chat", chat, IDENT).block_keys
    )


def test_the_billing_header_claude_code_changes_on_every_request_is_not_keyed() -> None:
    norm = _norm()

    def keys(header: str) -> list[int]:
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cch={header};"},
            {"type": "text", "text": SYSTEM},
        ]
        inline = {"role": "system", "content": f"x-anthropic-billing-header: cch={header};"}
        body = _messages(system, messages=[{"role": "user", "content": "hi"}, inline])
        return list(norm.canonicalize("messages", body, IDENT).block_keys)

    plain = norm.canonicalize("messages", _messages(SYSTEM), IDENT).block_keys
    assert keys("a1") == keys("b2") == list(plain)


def test_cache_control_marks_change_zones_never_keys() -> None:
    norm = _norm()
    tools = [{"name": "weather", "input_schema": TOOL_SCHEMA}]

    def prompt(system_marks: tuple[int, ...], tool_mark: bool, with_tools: bool = True) -> CanonicalPrompt:
        blocks: list[dict[str, Any]] = [
            {"type": "text", "text": SYSTEM},
            {"type": "text", "text": "Today: x."},
        ]
        for j in system_marks:
            blocks[j] = {**blocks[j], "cache_control": {"type": "ephemeral"}}
        marked = [{**t, "cache_control": {"type": "ephemeral"}} for t in tools] if tool_mark else tools
        return norm.canonicalize(
            "messages", _messages(blocks, **({"tools": marked} if with_tools else {})), IDENT
        )

    plain, last, early, tool_only = (
        prompt((), False),
        prompt((1,), False),
        prompt((0,), False),
        prompt((), True),
    )
    # The default zone rules already make the system and the tools immutable; the last block's mark agrees.
    assert last.block_keys == plain.block_keys and _immutable_end(last) == _immutable_end(plain) > 0
    # A mark inside the system message: only the tools are immutable (zones end at messages).
    assert _immutable_end(early) < _immutable_end(last) and any("system[0]" in d for d in early.diagnostics)
    assert _immutable_end(prompt((0,), False, with_tools=False)) == 0
    # The last tool's mark alone: the tools, not the system, form the immutable zone.
    assert 0 < _immutable_end(tool_only) < _immutable_end(last)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]}, "tools[0].name"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ],
)
def test_messages_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(NormalizerError) as info:
        _norm().canonicalize("messages", body, IDENT)
    assert info.value.param == param


def test_anthropic_blocks_convert_as_vllm_converts_them() -> None:
    norm = _norm(canonical_json=False)  # tool-call arguments as the worker gets them
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "call the tool"},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21C"}]},
        ]
    }
    chat = _chat(
        [
            {"role": "user", "content": "weather?"},  # one text block: a plain string
            {
                "role": "assistant",
                "reasoning": "call the tool",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "21C"},
        ]
    )
    assert (
        norm.canonicalize("messages", body, IDENT).block_keys
        == norm.canonicalize("chat", chat, IDENT).block_keys
    )


def test_drift_names_the_clients_own_field() -> None:
    norm = _norm()
    base = {"instructions": SYSTEM, "prompt_cache_key": "s1"}
    norm.canonicalize("responses", {**base, "input": [{"role": "user", "content": "a" * 64}]}, IDENT)
    second = norm.canonicalize("responses", {**base, "input": [{"role": "user", "content": "b" * 64}]}, IDENT)
    assert second.drift is not None and second.drift.field == "input[0].content"


def test_tokenizer_mode_keys_equal_the_chat_request(tiny_model_dir: Path) -> None:
    norm = _norm(mode="tokenizer", tokenizer_dir=str(tiny_model_dir))
    responses = norm.canonicalize(
        "responses", {"instructions": SYSTEM, "input": "hello there"}, IDENT, PUBLIC
    )
    chat = norm.canonicalize(
        "chat",
        _chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]),
        IDENT,
        PUBLIC,
    )
    assert responses.block_keys == chat.block_keys and responses.zones == chat.zones


def test_render_mode_renders_the_converted_chat_and_forwards_nothing_of_it() -> None:
    norm = _norm(mode="render")
    plan = norm.prepare_render("messages", _messages(SYSTEM))
    assert plan.render_path == "/v1/chat/completions/render"
    assert plan.body["model"] == "m" and plan.body["messages"][0] == {"role": "system", "content": SYSTEM}
    with pytest.raises(NormalizerError) as info:
        norm.prepare_render("responses", {"input": "x", "previous_response_id": "resp_1"})
    assert info.value.code == "render_empty"
    empty = norm.canonicalize("responses", {"input": "x", "previous_response_id": "resp_1"}, IDENT)
    assert empty.n_tokens == 0
    prompt = norm.from_render(plan, list(range(40)), IDENT)
    assert prompt.canonical_body is None and len(prompt.block_keys) == 10


def test_a_function_tool_whose_parameters_are_null_has_no_schema() -> None:
    # The OpenAI SDK's typed tools always send `parameters`, None for a tool without arguments;
    # vLLM takes it as absent.
    norm = _norm()
    chat_tool = {"type": "function", "function": {"name": "now", "parameters": None}}
    chat = norm.canonicalize("chat", _chat([{"role": "user", "content": "hi"}], tools=[chat_tool]), IDENT)
    flat = {"type": "function", "name": "now", "parameters": None}
    responses = norm.canonicalize("responses", {"model": "m", "input": "hi", "tools": [flat]}, IDENT)
    assert chat.block_keys and responses.block_keys
