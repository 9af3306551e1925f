"""Emulator pieces without a process: chat template, tool arguments, tokenizers, request
validation, answers and the KV-event encoders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from loadtest.emulator.chat_template import render_chat
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.kv_events import encode_cleared, encode_removed, encode_stored
from loadtest.emulator.live import StoredBlocks
from loadtest.emulator.output import AnswerWriter
from loadtest.emulator.protocol import parse_chat, parse_completions
from loadtest.emulator.tools import choose_tool, example_value, tool_call_arguments
from loadtest.engine.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

CFG = EmulatorConfig(model="m")
TOK = ByteTokenizer()


def test_template_renders_roles_tools_and_generation_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = render_chat(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        tools,
    )
    assert text == (
        "<|system|>\nsys<|end|>\n"
        '<|tools|>\n[{"function":{"name":"f"},"type":"function"}]<|end|>\n'
        "<|user|>\nab<|end|>\n"
        "<|assistant|>\n<|tool_call|>f {}<|end|>\n"
        "<|tool|>\nc1\nok<|end|>\n"
        "<|assistant|>\n"
    )
    # The assistant turn renders as generation prompt + answer, so a next turn shares the prefix.
    prompt = render_chat([{"role": "user", "content": "q"}], None)
    turn2 = render_chat(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ANS"}], None, False
    )
    assert turn2.startswith(prompt + "ANS")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        (["x"], "messages[0]"),
        ([{"role": "assistant", "content": "", "tool_calls": [{}]}], "messages[0].tool_calls[0]"),
    ],
)
def test_template_errors_name_the_field(messages: list[object], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        render_chat(messages, None)
    assert exc.value.status == 400 and exc.value.param == param


def test_tool_arguments_follow_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer", "minimum": 3},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "e": {"enum": ["x", "y"]},
            "a": {"type": "array", "items": {"type": "integer"}},
            "o": {"type": "object", "properties": {"k": {"type": ["null", "string"]}}},
            "opt": {"type": "string"},
        },
        "required": ["s", "i", "n", "b", "e", "a", "o"],
    }
    name, args = tool_call_arguments({"type": "function", "function": {"name": "t", "parameters": schema}})
    assert name == "t"
    assert json.loads(args) == {
        "s": "example s",
        "i": 3,
        "n": 1.0,
        "b": True,
        "e": "x",
        "a": [1],
        "o": {"k": "example k"},
    }
    assert example_value({"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 1


def test_tool_choice_rules() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    user = [{"role": "user", "content": "x"}]
    after_tool = [*user, {"role": "tool", "content": "r"}]
    assert choose_tool(tools, None, user) is tools[0]
    assert choose_tool(tools, {"type": "function", "function": {"name": "b"}}, user) is tools[1]
    assert choose_tool(tools, "none", user) is None
    assert choose_tool(tools, "auto", after_tool) is None
    assert choose_tool(None, "auto", user) is None
    with pytest.raises(ApiError, match="unknown tool"):
        choose_tool(tools, {"type": "function", "function": {"name": "zz"}}, user)
    with pytest.raises(ApiError) as exc:
        choose_tool([{"type": "function"}], None, user)
    assert exc.value.param == "tools[0].function.name"


def test_byte_tokenizer_counts_bytes_and_pieces_rejoin() -> None:
    assert len(TOK.encode("a" * 512)) == 512
    text = "héllo €"
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode()) and TOK.decode(ids) == text
    pieces = TOK.pieces(text)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    with pytest.raises(TokenizerError):
        TOK.decode([300])


def test_hf_tokenizer_from_local_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cache keeps every prefix it has seen"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = load_tokenizer(str(path))
    assert isinstance(hf, HFTokenizer)
    text = "the cache keeps every prefix"
    ids = hf.encode(text)
    assert 0 < len(ids) < len(text)  # merges learned: fewer tokens than bytes
    pieces = hf.pieces(text)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    answer = AnswerWriter(hf, seed=1).text_answer(ids, 10)
    assert len(answer.pieces) == 10
    with pytest.raises(TokenizerError):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_answers_are_deterministic_and_exact_length() -> None:
    writer = AnswerWriter(TOK, seed=3)
    a = writer.text_answer(TOK.encode("prompt one"), 50)
    assert len(a.pieces) == 50 and len(a.token_ids) == 50 and a.text.isascii()
    assert writer.text_answer(TOK.encode("prompt one"), 50).text == a.text
    assert writer.text_answer(TOK.encode("prompt one"), 20).text == a.text[:20]
    assert writer.text_answer(TOK.encode("prompt two"), 50).text != a.text
    assert len(writer.text_answer(TOK.encode("p"), 100_000).pieces) == 100_000


def test_request_validation() -> None:
    gen = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}, CFG, TOK
    )
    assert gen.max_tokens == 9 and not gen.stream and gen.tool_call is None
    gen = parse_completions(
        {"prompt": ["abc"], "stream": True, "stream_options": {"include_usage": True}}, CFG, TOK
    )
    assert gen.prompt_ids.tolist() == [97, 98, 99] and gen.include_usage
    assert parse_completions({"prompt": [[1, 2]]}, CFG, TOK).prompt_ids.tolist() == [1, 2]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),  # lax mode reads true, "5" and 5.0
        ({"prompt": "x", "max_tokens": "five"}, "max_tokens"),
        ({"prompt": "x", "stream": "maybe"}, "stream"),  # and "yes"
        ({"prompt": ["a", 5]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "request_id": ""}, "request_id"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "cache_salt": "s" * 1025}, "cache_salt"),
    ]
    for body, param in bad:
        with pytest.raises(ApiError) as exc:
            parse_completions(body, CFG, TOK)
        assert exc.value.param == param, body


def test_kv_event_encodings_round_trip() -> None:
    ev = StoredBlocks((2**64 - 1, 5), None, list(range(32)), "salt", 0)
    arr = msgpack.unpackb(msgpack.packb(encode_stored(ev, 16, "array")))
    assert arr == [
        "BlockStored",
        [2**64 - 1, 5],
        None,
        list(range(32)),
        16,
        None,
        "GPU",
        None,
        [["salt"], None],
    ]
    mp = msgpack.unpackb(msgpack.packb(encode_stored(ev, 16, "map")))
    assert (
        mp["type"] == "BlockStored" and mp["block_hashes"][0] == 2**64 - 1 and mp["extra_keys"][0] == ["salt"]
    )
    unsalted = StoredBlocks((7,), 5, list(range(16)), None, 2)
    assert len(encode_stored(unsalted, 16, "array")) == 8  # trailing defaults omitted
    assert encode_removed([1, 2], "array") == ["BlockRemoved", [1, 2], "GPU"]
    assert encode_removed([1], "map")["type"] == "BlockRemoved"
    assert encode_cleared("array") == ["AllBlocksCleared"] and encode_cleared("map") == {
        "type": "AllBlocksCleared"
    }
    assert np.uint64(arr[1][0]) == np.uint64(2**64 - 1)
