"""Fuzz: any JSON body gives a CanonicalPrompt or a NormalizerError, never another exception, and
the caller's body is never mutated (hypothesis; chat, completions, Responses and Anthropic
Messages; every rendering mode)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prompt_normalizer.config import VolatileRule
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import CanonicalPrompt, KeyIdentity

pytestmark = pytest.mark.slow

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

text = st.text(max_size=30)
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_value = st.recursive(
    leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)


def _maybe(shaped: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the expected shape, sometimes anything at all (one field at a time goes wrong)."""
    return st.integers(0, 7).flatmap(lambda pick: shaped if pick else json_value)


part = _maybe(
    st.fixed_dictionaries(
        {"type": _maybe(st.sampled_from(["text", "image_url", "input_audio"]))},
        optional={"text": _maybe(text), "image_url": json_value},
    )
)
call = _maybe(
    st.fixed_dictionaries(
        {
            "type": _maybe(st.sampled_from(["function", "function", "custom"])),
            "function": _maybe(
                st.fixed_dictionaries(
                    {"name": _maybe(text)},
                    optional={"arguments": _maybe(st.sampled_from(['{"b": 1, "a": 2}', "[1]", "x", "{"]))},
                )
            ),
        },
        optional={"id": _maybe(text)},
    )
)
message = _maybe(
    st.fixed_dictionaries(
        {"role": _maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
        optional={
            "content": _maybe(st.one_of(text, st.lists(part, max_size=3))),
            "tool_calls": _maybe(st.lists(call, max_size=3)),
            "reasoning_content": json_value,
            "name": _maybe(st.sampled_from(["example_user", "bob"])),
            "tool_call_id": json_value,
        },
    )
)
tool = _maybe(
    st.fixed_dictionaries(
        {"type": _maybe(st.just("function"))},
        optional={
            "function": _maybe(
                st.fixed_dictionaries({"name": _maybe(text)}, optional={"parameters": json_value})
            )
        },
    )
)
chat_body = _maybe(
    st.fixed_dictionaries(
        {"messages": _maybe(st.lists(message, min_size=1, max_size=5))},
        optional={
            "model": json_value,
            "tools": _maybe(st.lists(tool, max_size=3)),
            "chat_template_kwargs": _maybe(st.dictionaries(text, json_value, max_size=3)),
            "documents": _maybe(st.lists(st.dictionaries(text, text, max_size=2), max_size=2)),
            "chat_template": json_value,
            "add_generation_prompt": _maybe(st.booleans()),
            "continue_final_message": _maybe(st.booleans()),
            "add_special_tokens": _maybe(st.booleans()),
            "user": json_value,
            "prompt_cache_key": _maybe(text),
        },
    )
)
token_ids = st.lists(st.integers(-5, 2**33), max_size=40)
completions_body = _maybe(
    st.fixed_dictionaries(
        {
            "prompt": _maybe(
                st.one_of(text, token_ids, st.lists(text, max_size=3), st.lists(token_ids, max_size=2))
            )
        },
        optional={"add_special_tokens": _maybe(st.booleans()), "user": json_value},
    )
)

cache_control = st.one_of(st.none(), st.just({"type": "ephemeral"}), json_value)
response_part = _maybe(
    st.fixed_dictionaries(
        {"type": _maybe(st.sampled_from(["input_text", "output_text", "input_image", "input_file"]))},
        optional={"text": _maybe(text), "image_url": _maybe(text)},
    )
)
response_item = _maybe(
    st.fixed_dictionaries(
        {
            "type": _maybe(
                st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])
            )
        },
        optional={
            "role": _maybe(st.sampled_from(["user", "system", "developer", "assistant", "tool"])),
            "content": _maybe(st.one_of(text, st.lists(response_part, max_size=3))),
            "name": _maybe(text),
            "arguments": _maybe(text),
            "call_id": json_value,
            "output": json_value,
        },
    )
)
responses_body = _maybe(
    st.fixed_dictionaries(
        {"input": _maybe(st.one_of(text, st.lists(response_item, max_size=4)))},
        optional={
            "instructions": _maybe(text),
            "previous_response_id": _maybe(text),
            "tools": _maybe(
                st.lists(
                    _maybe(
                        st.fixed_dictionaries({"type": _maybe(st.just("function")), "name": _maybe(text)})
                    ),
                    max_size=3,
                )
            ),
            "prompt_cache_key": _maybe(text),
        },
    )
)
anthropic_block = _maybe(
    st.fixed_dictionaries(
        {
            "type": _maybe(
                st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document"])
            )
        },
        optional={
            "text": _maybe(text),
            "source": json_value,
            "name": _maybe(text),
            "input": json_value,
            "content": json_value,
            "thinking": _maybe(text),
            "cache_control": cache_control,
        },
    )
)
messages_body = _maybe(
    st.fixed_dictionaries(
        {
            "messages": _maybe(
                st.lists(
                    _maybe(
                        st.fixed_dictionaries(
                            {
                                "role": _maybe(st.sampled_from(["user", "assistant"])),
                                "content": _maybe(st.one_of(text, st.lists(anthropic_block, max_size=3))),
                            }
                        )
                    ),
                    min_size=1,
                    max_size=4,
                )
            )
        },
        optional={
            "system": _maybe(
                st.one_of(
                    text,
                    st.lists(
                        _maybe(
                            st.fixed_dictionaries(
                                {"type": st.just("text"), "text": _maybe(text)},
                                optional={"cache_control": cache_control},
                            )
                        ),
                        max_size=3,
                    ),
                )
            ),
            "tools": _maybe(
                st.lists(
                    _maybe(
                        st.fixed_dictionaries(
                            {"name": _maybe(text)},
                            optional={"input_schema": json_value, "cache_control": cache_control},
                        )
                    ),
                    max_size=3,
                )
            ),
        },
    )
)

RULES = (
    VolatileRule(name="clock", pattern=r"[0-9]+", action="move_to_end"),
    VolatileRule(name="reasoning", field="reasoning_content", scope="before_last_user", action="drop"),
    VolatileRule(name="warn", pattern="a", action="keep_and_warn"),
)


def _normalizers(model_dir: Path) -> list[Normalizer]:
    return [
        Normalizer(NormalizerConfig(), b"fuzz"),
        Normalizer(NormalizerConfig(volatile_rules=RULES, whitespace=True, tool_order="sort"), b"fuzz"),
        Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(model_dir)), b"fuzz"),
        Normalizer(NormalizerConfig(mode="render"), b"fuzz"),
    ]


@pytest.fixture(scope="module")
def normalizers(tiny_model_dir: Path) -> list[Normalizer]:
    return _normalizers(tiny_model_dir)


def _check(norm: Normalizer, endpoint: str, body: Any) -> None:
    before = copy.deepcopy(body)
    for public in (None, public_identity_of(IDENT)):
        try:
            result = norm.canonicalize(endpoint, body, IDENT, public)  # type: ignore[arg-type]
        except NormalizerError as exc:
            assert exc.message and exc.code
            continue
        assert isinstance(result, CanonicalPrompt)
        assert len(result.block_keys) == result.n_tokens // IDENT.block_size_tokens
    if norm.config.mode == "render":
        with contextlib.suppress(NormalizerError):
            norm.prepare_render(endpoint, body)  # type: ignore[arg-type]
    assert body == before


@FUZZ
@given(body=chat_body)
def test_chat_fuzz(normalizers: list[Normalizer], body: Any) -> None:
    for norm in normalizers:
        _check(norm, "chat", body)


@FUZZ
@given(body=completions_body)
def test_completions_fuzz(normalizers: list[Normalizer], body: Any) -> None:
    for norm in normalizers:
        _check(norm, "completions", body)


@FUZZ
@given(body=responses_body)
def test_responses_fuzz(normalizers: list[Normalizer], body: Any) -> None:
    for norm in normalizers:
        _check(norm, "responses", body)


@FUZZ
@given(body=messages_body)
def test_messages_fuzz(normalizers: list[Normalizer], body: Any) -> None:
    for norm in normalizers:
        _check(norm, "messages", body)


@settings(max_examples=60, deadline=None)
@given(
    body=json_value, endpoint=st.sampled_from(["chat", "completions", "responses", "messages", "embeddings"])
)
def test_any_json_value_as_body(body: Any, endpoint: str) -> None:
    _check(Normalizer(NormalizerConfig(), b"fuzz"), endpoint, body)
