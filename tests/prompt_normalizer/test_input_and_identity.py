"""Bad structured input is a NormalizerError naming the field; public keys follow the request
identity; template dates come from configuration, never from the clock."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity
from tests.prompt_normalizer.tiny_model import build_tiny_model

IDENT = KeyIdentity(model_id="m", weights_version="w1", namespace="t1", block_size_tokens=4, epoch=3)
SYSTEM = {"role": "system", "content": "You are terse. " * 20}


def _assistant(**extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, **extra}


def _chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [SYSTEM, {"role": "user", "content": "hi"}, *messages], **extra}


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", _chat(_assistant(tool_calls=5)), "messages[2].tool_calls"),
        ("chat", _chat(_assistant(tool_calls="f()")), "messages[2].tool_calls"),
        ("chat", _chat(_assistant(tool_calls={"id": "c1"})), "messages[2].tool_calls"),
        ("chat", _chat(_assistant(tool_calls=[5])), "messages[2].tool_calls[0]"),
        ("chat", _chat(_assistant(tool_calls=[CALL, "x"])), "messages[2].tool_calls[1]"),
        ("chat", _chat(_assistant(tool_calls=[{"function": 5}])), "messages[2].tool_calls[0].function"),
        (
            "chat",
            _chat(_assistant(tool_calls=[{"type": "function", "function": {"arguments": "{}"}}])),
            "messages[2].tool_calls[0].function",
        ),
        (
            "chat",
            _chat(_assistant(tool_calls=[{"function": {"name": "f", "arguments": 5}}])),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            "chat",
            _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "zz"}}]),
            "tools[0].function.parameters",
        ),
        ("chat", _chat(documents=5), "documents"),
        ("chat", _chat(documents=[{"text": "a"}, "b"]), "documents[1]"),
        ("chat", _chat(chat_template=["x"]), "chat_template"),
        ("chat", _chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
        ("chat", _chat(add_generation_prompt="maybe"), "add_generation_prompt"),
        ("chat", _chat(continue_final_message=2), "continue_final_message"),
        ("chat", _chat(add_special_tokens="nope"), "add_special_tokens"),
    ],
)
def test_bad_structure_is_a_normalizer_error_with_param(
    endpoint: str, body: dict[str, Any], param: str, tiny_model_dir: Path
) -> None:
    for config in (
        NormalizerConfig(),
        NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir)),
    ):
        with pytest.raises(NormalizerError) as err:
            Normalizer(config, b"s").canonicalize(endpoint, body, IDENT)  # type: ignore[arg-type]
        assert err.value.param == param, config.mode


def test_completions_add_special_tokens_must_be_boolean(tiny_model_dir: Path) -> None:
    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir)), b"s")
    with pytest.raises(NormalizerError) as err:
        norm.canonicalize("completions", {"prompt": "hello", "add_special_tokens": "nope"}, IDENT)
    assert err.value.param == "add_special_tokens"


def test_valid_tool_calls_still_pass() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    other = {"id": "c2", "type": "custom", "custom": {"name": "g", "input": "x"}}
    dict_args = {"id": "c3", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    prompt = norm.canonicalize("chat", _chat(_assistant(tool_calls=[CALL, other, dict_args])), IDENT)
    assert prompt.block_keys


def test_public_keys_derive_from_the_request_identity() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    body = _chat()
    public = public_identity_of(IDENT)
    assert public == dataclasses.replace(IDENT, namespace=PUBLIC_NAMESPACE)
    prompt = norm.canonicalize("chat", body, IDENT, public)
    assert prompt.public_block_keys
    # The public keys are exactly the keys a public-namespace request of the same prompt gets.
    as_public = norm.canonicalize("chat", body, public)
    n = len(prompt.public_block_keys)
    assert prompt.public_block_keys == as_public.block_keys[:n]
    # An equal identity built separately is accepted and gives the same keys.
    again = norm.canonicalize("chat", body, IDENT, dataclasses.replace(public))
    assert again.public_block_keys == prompt.public_block_keys


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "t1"},
        {"weights_version": "w0"},
        {"epoch": 0},
        {"model_id": "other"},
        {"adapter": "lora"},
        {"block_size_tokens": 8},
    ],
)
def test_inconsistent_public_identity_is_rejected(change: dict[str, Any]) -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    wrong = dataclasses.replace(public_identity_of(IDENT), **change)
    for endpoint, body in (("chat", _chat()), ("completions", {"prompt": list(range(64))})):
        with pytest.raises(NormalizerError) as err:
            norm.canonicalize(endpoint, body, IDENT, wrong)  # type: ignore[arg-type]
        assert err.value.code == "bad_identity"


def _dated_model(tmp_path: Path) -> Path:
    model = build_tiny_model(tmp_path / "dated")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if date_string is not defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
        "<|im_start|>system\nToday: {{ date_string }}<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_template_dates_are_fixed_or_request_supplied(tmp_path: Path) -> None:
    model = str(_dated_model(tmp_path))
    config = NormalizerConfig(mode="tokenizer", tokenizer_dir=model)
    norm = Normalizer(config, b"s")
    tok = norm.chat_tokenizer
    assert tok is not None
    from prompt_normalizer.canonical import canonicalize_chat

    body = {"messages": [{"role": "user", "content": "hello there, how are you today?"}]}
    text = tok.render(canonicalize_chat(body, config, b"k" * 32))
    assert "Today: 01 Jan 2025" in text
    assert datetime.now().strftime("%d %b %Y") not in text
    first = norm.canonicalize("chat", body, IDENT).block_keys
    assert first == Normalizer(config, b"s").canonicalize("chat", body, IDENT).block_keys

    later = NormalizerConfig(mode="tokenizer", tokenizer_dir=model, template_time=datetime(2031, 6, 2))
    later_text = Normalizer(later, b"s").chat_tokenizer.render(  # type: ignore[union-attr]
        canonicalize_chat(body, later, b"k" * 32)
    )
    assert "Today: 02 Jun 2031" in later_text

    supplied = {**body, "chat_template_kwargs": {"date_string": "24 Dec 2030"}}
    supplied_text = tok.render(canonicalize_chat(supplied, config, b"k" * 32))
    assert "Today: 24 Dec 2030" in supplied_text


def test_template_type_errors_become_normalizer_errors(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "strict")
    config = json.loads((model / "tokenizer_config.json").read_text())
    # Adds a string to whatever the request put in `documents`: a list is a TypeError in Jinja.
    config["chat_template"] = "{{ 'docs: ' + documents }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(model)), b"s")
    body = {"messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "a"}]}
    with pytest.raises(NormalizerError) as err:
        norm.canonicalize("chat", body, IDENT)
    assert err.value.code == "template_error"
