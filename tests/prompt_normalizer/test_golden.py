"""Golden test: a real (tiny, trained here) BPE and a real Jinja chat template on a tool-using
conversation; zone spans and keys checked against a hand-written rendering and a slow reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity, Zone
from tests.prompt_normalizer.reference import reference_keys

SECRET = b"golden-secret"

BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "c", "city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "user", "content": "Thanks!"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "description": "Weather now",
            },
        }
    ],
}

# What the template must produce once canonical JSON sorted the tool schema, the call arguments and
# the JSON tool result (written by hand from the template, not produced by the code under test).
IMMUTABLE_TEXT = (
    "<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n<tools>\n"
    '{"function": {"description": "Weather now", "name": "get_weather", "parameters": '
    '{"properties": {"city": {"type": "string"}}, "type": "object"}}, "type": "function"}\n'
    "</tools><|im_end|>\n"
)
CONVERSATION_TEXT = (
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}</tool_call><|im_end|>\n'
    '<|im_start|>tool\n{"sky":"sunny","temp":21}<|im_end|>\n'
    "<|im_start|>user\nThanks!<|im_end|>\n"
)
GENERATION_TEXT = "<|im_start|>assistant\n"


def test_tool_conversation_spans_and_keys(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    full = tok.encode(IMMUTABLE_TEXT + CONVERSATION_TEXT + GENERATION_TEXT, add_special_tokens=False).ids
    n_immutable = len(tok.encode(IMMUTABLE_TEXT, add_special_tokens=False).ids)
    # Special tokens split the text, so the prefix tokenizes to a prefix of the full ids.
    assert full[:n_immutable] == tok.encode(IMMUTABLE_TEXT, add_special_tokens=False).ids

    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir)), SECRET)
    identity = KeyIdentity(model_id="tiny", namespace="tenant-a", block_size_tokens=16)
    public = KeyIdentity(model_id="tiny", namespace=PUBLIC_NAMESPACE, block_size_tokens=16)
    prompt = norm.canonicalize("chat", BODY, identity, public)

    assert prompt.n_tokens == len(full)
    assert [(z.zone, z.start_token, z.end_token) for z in prompt.zones] == [
        (Zone.IMMUTABLE, 0, n_immutable),
        (Zone.APPEND_ONLY, n_immutable, len(full)),
    ]
    assert prompt.zones[0].source == "messages[0:1]+tools"
    expected = reference_keys(SECRET, identity, full)
    assert len(expected) == len(full) // 16 and len(expected) > 0
    assert list(prompt.block_keys) == expected
    assert list(prompt.public_block_keys) == reference_keys(SECRET, public, full)[: n_immutable // 16]
    assert prompt.immutable_blocks == n_immutable // 16
    # The keys describe the canonical body, which the gateway forwards.
    assert prompt.canonical_body is not None
    assert prompt.canonical_body["messages"][3]["content"] == '{"sky":"sunny","temp":21}'
    assert BODY["messages"][3]["content"] == '{"temp": 21, "sky": "sunny"}'  # caller's body untouched
    assert set(prompt.diagnostics) == {
        "canonical_json: reordered keys of tools[0]",
        "canonical_json: rewrote messages[2].tool_calls[0].function.arguments",
        "canonical_json: rewrote messages[3].content",
    }


def test_volatile_tail_span_and_stable_prefix(tiny_model_dir: Path) -> None:
    from prompt_normalizer.config import VolatileRule

    rule = VolatileRule(name="clock", pattern=r"Now: \d\d:\d\d", roles=("user",), action="move_to_end")
    config = NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir), volatile_rules=(rule,))
    norm = Normalizer(config, SECRET)
    identity = KeyIdentity(model_id="tiny", namespace="t", block_size_tokens=4)

    def body(clock: str) -> dict[str, Any]:
        messages = [dict(m) for m in BODY["messages"]]
        messages[1]["content"] = f"Now: {clock} Weather in Paris?"
        return {**BODY, "messages": messages}

    a = norm.canonicalize("chat", body("10:00"), identity)
    b = norm.canonicalize("chat", body("11:59"), identity)
    zones = [z.zone for z in a.zones]
    assert zones == [Zone.IMMUTABLE, Zone.APPEND_ONLY, Zone.VOLATILE]
    volatile = a.zones[2]
    assert volatile.end_token == a.n_tokens and volatile.source == "messages[5]"
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tail = tok.encode(
        "<|im_start|>system\nNow: 10:00<|im_end|>\n" + GENERATION_TEXT, add_special_tokens=False
    ).ids
    assert a.n_tokens - volatile.start_token == len(tail)
    # Everything before the volatile tail is shared whatever the clock says.
    stable_blocks = volatile.start_token // 4
    assert a.block_keys[:stable_blocks] == b.block_keys[:stable_blocks]
    assert a.block_keys != b.block_keys
