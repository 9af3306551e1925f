"""Property tests of the key contract (hypothesis)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
IDENT = KeyIdentity(model_id="m", weights_version="w1", namespace="tenant-a", block_size_tokens=8)
NORM = Normalizer(NormalizerConfig(), b"prop-secret")

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=200)
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=120)
json_leaf = st.one_of(st.integers(-1000, 1000), st.booleans(), st.text(max_size=8))
schemas = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.one_of(json_leaf, st.dictionaries(st.text(min_size=1, max_size=4), json_leaf)),
    min_size=2,
    max_size=6,
)


def _chat(system: str, user: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
    }
    if tools is not None:
        body["tools"] = tools
    return body


@FAST
@given(tokens=token_lists, system=texts, user=texts)
def test_same_request_same_keys(tokens: list[int], system: str, user: str) -> None:
    other = Normalizer(NormalizerConfig(), b"prop-secret")
    for endpoint, body in (("completions", {"prompt": tokens}), ("chat", _chat(system * 5, user))):
        a = NORM.canonicalize(endpoint, body, IDENT)  # type: ignore[arg-type]
        b = other.canonicalize(endpoint, body, IDENT)  # type: ignore[arg-type]
        assert a.block_keys == b.block_keys and a.zones == b.zones


@FAST
@given(prefix=token_lists, tail_a=token_lists, tail_b=token_lists, block=st.sampled_from([1, 4, 16]))
def test_shared_prefix_shares_exactly_floor_m_over_b_keys(
    prefix: list[int], tail_a: list[int], tail_b: list[int], block: int
) -> None:
    ident = dataclasses.replace(IDENT, block_size_tokens=block)
    a_ids, b_ids = prefix + tail_a, prefix + tail_b
    m = len(prefix)
    while m < min(len(a_ids), len(b_ids)) and a_ids[m] == b_ids[m]:
        m += 1
    a = NORM.canonicalize("completions", {"prompt": a_ids}, ident).block_keys
    b = NORM.canonicalize("completions", {"prompt": b_ids}, ident).block_keys
    shared = m // block
    assert a[:shared] == b[:shared]
    later_a, later_b = set(a[shared:]), set(b[shared:])
    if m < min(len(a_ids), len(b_ids)):  # they really diverge at token m
        assert not later_a & set(b) and not later_b & set(a)
    assert len(a) == len(a_ids) // block


@FAST
@given(text=texts, cut=st.integers(0, 120), tail_a=texts, tail_b=texts)
def test_approximate_text_shares_floor_chars_over_chunk(
    text: str, cut: int, tail_a: str, tail_b: str
) -> None:
    a_text, b_text = text + tail_a, text + tail_b
    m = 0
    while m < min(len(a_text), len(b_text)) and a_text[m] == b_text[m]:
        m += 1
    ident = dataclasses.replace(IDENT, block_size_tokens=2)  # 8 characters per block
    a = NORM.canonicalize("completions", {"prompt": a_text}, ident).block_keys
    b = NORM.canonicalize("completions", {"prompt": b_text}, ident).block_keys
    assert a[: m // 8] == b[: m // 8]
    if m < min(len(a_text), len(b_text)):
        assert not set(a[m // 8 :]) & set(b)


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    return value


def _tools(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}]


def _tool_order_keys(norm: Normalizer, schema: dict[str, Any], seed: int) -> tuple[bool, bool]:
    ident = dataclasses.replace(IDENT, block_size_tokens=4)
    rng = random.Random(seed)
    reordered = _shuffled(schema, rng)
    while list(reordered) == list(schema):  # make sure the key order really differs
        reordered = _shuffled(schema, rng)
    system = "You are a careful assistant. " * 4
    a = norm.canonicalize("chat", _chat(system, "hi", _tools(schema)), ident).block_keys
    b = norm.canonicalize("chat", _chat(system, "hi", _tools(reordered)), ident).block_keys
    return a == b, bool(a) and bool(b)


@FAST
@given(schema=schemas, seed=st.integers(0, 10_000))
def test_tool_key_order_absorbed_only_with_canonical_json(schema: dict[str, Any], seed: int) -> None:
    same_on, _ = _tool_order_keys(Normalizer(NormalizerConfig(canonical_json=True), b"s"), schema, seed)
    same_off, _ = _tool_order_keys(Normalizer(NormalizerConfig(canonical_json=False), b"s"), schema, seed)
    assert same_on
    assert not same_off


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 10_000))
def test_tool_key_order_with_real_template(tiny_model_dir: Path, schema: dict[str, Any], seed: int) -> None:
    base = {"mode": "tokenizer", "tokenizer_dir": str(tiny_model_dir)}
    same_on, _ = _tool_order_keys(
        Normalizer(NormalizerConfig(**base, canonical_json=True), b"s"), schema, seed
    )
    same_off, _ = _tool_order_keys(
        Normalizer(NormalizerConfig(**base, canonical_json=False), b"s"), schema, seed
    )
    assert same_on and not same_off


IDENTITY_CHANGES = [
    {"namespace": "tenant-b"},
    {"namespace": "public"},
    {"model_id": "m2"},
    {"weights_version": "w2"},
    {"tokenizer_version": "tok2"},
    {"template_version": "tpl2"},
    {"adapter": "lora-x"},
    {"kv_dtype": "fp8"},
    {"epoch": 1},
]


@FAST
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=8, max_size=200),
    change=st.sampled_from(IDENTITY_CHANGES),
)
def test_any_identity_change_shares_no_key(tokens: list[int], change: dict[str, Any]) -> None:
    other = dataclasses.replace(IDENT, **change)
    a = NORM.canonicalize("completions", {"prompt": tokens}, IDENT).block_keys
    b = NORM.canonicalize("completions", {"prompt": tokens}, other).block_keys
    assert a and not set(a) & set(b)
    chat = _chat("system prompt " * 10, "question")
    assert not set(NORM.canonicalize("chat", chat, IDENT).block_keys) & set(
        NORM.canonicalize("chat", chat, other).block_keys
    )


def test_different_secret_shares_no_key() -> None:
    tokens = list(range(512))
    a = NORM.canonicalize("completions", {"prompt": tokens}, IDENT).block_keys
    b = (
        Normalizer(NormalizerConfig(), b"another")
        .canonicalize("completions", {"prompt": tokens}, IDENT)
        .block_keys
    )
    assert not set(a) & set(b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shared=st.text(alphabet="abc xyz,.{}", max_size=60),
    tail_a=st.text(alphabet="abc xyz,.{}", max_size=40),
    tail_b=st.text(alphabet="abc xyz,.{}", max_size=40),
    block=st.sampled_from([2, 4, 8]),
)
def test_chat_keys_follow_the_real_token_prefix(
    tiny_model_dir: Path, shared: str, tail_a: str, tail_b: str, block: int
) -> None:
    from prompt_normalizer.canonical import canonicalize_chat
    from prompt_normalizer.template import ChatTemplateTokenizer

    config = NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir))
    norm = Normalizer(config, b"s")
    tok = ChatTemplateTokenizer(str(tiny_model_dir))
    ident = dataclasses.replace(IDENT, block_size_tokens=block)
    bodies = [_chat("You are a careful assistant.", shared + tail) for tail in (tail_a, tail_b)]
    ids = [
        tok.encode(
            tok.render(canonicalize_chat(b, config, b"k" * 32)), add_special_tokens=False, with_offsets=False
        ).tokens.tolist()
        for b in bodies
    ]
    m = 0
    while m < min(map(len, ids)) and ids[0][m] == ids[1][m]:
        m += 1
    a, b = (norm.canonicalize("chat", body, ident).block_keys for body in bodies)
    assert a[: m // block] == b[: m // block]
    if m < min(map(len, ids)):
        assert not set(a[m // block :]) & set(b)
    assert len(a) == len(ids[0]) // block


@FAST
@given(schema=schemas, seed=st.integers(0, 10_000), text=texts)
def test_canonicalization_is_idempotent(schema: dict[str, Any], seed: int, text: str) -> None:
    norm = Normalizer(NormalizerConfig(whitespace=True, tool_order="sort"), b"s")
    tools = _tools(_shuffled(schema, random.Random(seed))) + _tools(schema)[:1]
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"b": 1, "a": [2, {"d": 1, "c": 0}]}'},
    }
    body = _chat(" " + text + " \r\n", text + "e\u0301", tools)
    body["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": '{"z": 1, "y": 2}'},
    ]
    first = norm.canonicalize("chat", body, IDENT)
    again_body = first.canonical_body if first.canonical_body is not None else body
    again = norm.canonicalize("chat", again_body, IDENT)
    assert again.block_keys == first.block_keys and again.zones == first.zones
    assert again.canonical_body is None and again.diagnostics == ()
