"""The per-request fast paths (ASCII bodies skip NFC, flat messages read in place, remembered
immutable-prefix keys, cached identity roots and zone spans, prompts built through slot setters)
give exactly what the full computation gives."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prompt_normalizer.keys import PrefixKeyMemo, chain_keys, public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

IDENT = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200)


def _body(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **extra}


@pytest.mark.slow
@FAST
@given(system=texts, users=st.lists(texts, min_size=2, max_size=4), public=st.booleans())
def test_remembered_prefix_keys_equal_fresh_keys(system: str, users: list[str], public: bool) -> None:
    warm = Normalizer(NormalizerConfig(), b"s")
    pub = public_identity_of(IDENT) if public else None
    for user in users:  # the same system prompt again and again: later requests hit the memory
        body = _body(system * 3, user)
        hot = warm.canonicalize("chat", body, IDENT, pub)
        cold = Normalizer(NormalizerConfig(), b"s").canonicalize("chat", body, IDENT, pub)
        assert hot == cold


def test_memory_hit_after_first_request_and_keys_match_direct_chain() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    system = "You are a careful assistant. " * 40
    first = norm.canonicalize("chat", _body(system, "one"), IDENT, public_identity_of(IDENT))
    second = norm.canonicalize("chat", _body(system, "two two"), IDENT, public_identity_of(IDENT))
    n_public = len(first.public_block_keys)
    assert n_public >= 4 and second.public_block_keys == first.public_block_keys
    assert second.block_keys[:n_public] == first.block_keys[:n_public]
    # The same keys from the public identity's own chain (no memory involved).
    public_prompt = Normalizer(NormalizerConfig(), b"s").canonicalize(
        "chat", _body(system, "one"), public_identity_of(IDENT)
    )
    assert public_prompt.block_keys[:n_public] == first.public_block_keys


def test_prefix_memo_is_bounded_and_exact() -> None:
    memo = PrefixKeyMemo(b"k" * 32, max_entries=3, max_keys=40)
    block = 8
    spans = [bytes([i]) * (block * (4 + i)) for i in range(6)]
    for span in spans:
        view = memoryview(span)
        keys = memo.chain(view, memo.fingerprint(view), block, 7)
        assert keys == chain_keys(view, block, 7)
        again = memo.chain(view, memo.fingerprint(view), block, 7)
        assert again == keys
        assert len(memo) <= 3
    # A different seed for the same span is its own entry (roots never share keys).
    view = memoryview(spans[-1])
    assert memo.chain(view, memo.fingerprint(view), block, 8) == chain_keys(view, block, 8)


@pytest.mark.slow
@FAST
@given(text=texts)
def test_ascii_fast_path_agrees_with_nfc(text: str) -> None:
    import unicodedata

    norm = Normalizer(NormalizerConfig(), b"s")
    decomposed = unicodedata.normalize("NFD", text) + " café"
    composed = unicodedata.normalize("NFC", decomposed)
    a = norm.canonicalize("chat", _body(decomposed * 2, "q"), IDENT)
    b = norm.canonicalize("chat", _body(composed * 2, "q"), IDENT)
    assert a.block_keys == b.block_keys
    assert ("unicode_nfc: changed messages[0]" in a.diagnostics) == (decomposed != composed)
    assert b.diagnostics == ()


def test_identity_roots_follow_each_identity_object() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    body = _body("system prompt " * 20, "q")
    first = norm.canonicalize("chat", body, IDENT).block_keys
    other = dataclasses.replace(IDENT, epoch=1)
    assert not set(norm.canonicalize("chat", body, other).block_keys) & set(first)
    assert norm.canonicalize("chat", body, dataclasses.replace(IDENT)).block_keys == first


def test_shared_between_threads_gives_the_single_thread_answers() -> None:
    from concurrent.futures import ThreadPoolExecutor

    systems = [f"System prompt number {i}. " * 30 for i in range(6)]
    bodies = [_body(systems[i % 6], f"question {i}") for i in range(120)]
    pub = public_identity_of(IDENT)
    expected = [Normalizer(NormalizerConfig(), b"s").canonicalize("chat", b, IDENT, pub) for b in bodies]
    shared = Normalizer(NormalizerConfig(), b"s")
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda b: shared.canonicalize("chat", b, IDENT, pub), bodies))
    assert [(p.block_keys, p.public_block_keys, p.zones) for p in got] == [
        (p.block_keys, p.public_block_keys, p.zones) for p in expected
    ]


def test_flat_messages_read_in_place_are_never_shared_with_a_rewritten_body() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    tool = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}}
    body = _body("system prompt " * 20, "q", tools=[tool])
    prompt = norm.canonicalize("chat", body, IDENT)
    assert prompt.canonical_body is not None  # the tool's keys were sorted
    rewritten = prompt.canonical_body["messages"]
    assert rewritten == body["messages"]
    assert all(a is not b for a, b in zip(rewritten, body["messages"], strict=True))
    rewritten[0]["content"] = "changed"
    assert body["messages"][0]["content"] == "system prompt " * 20


def test_subclassed_and_non_string_values_take_the_copying_path_with_equal_results() -> None:
    class Text(str):
        pass

    norm = Normalizer(NormalizerConfig(), b"s")
    plain = _body("system prompt " * 20, "q")
    odd = _body(Text("system prompt " * 20), Text("q"))
    assert norm.canonicalize("chat", odd, IDENT) == norm.canonicalize("chat", plain, IDENT)
    named = _body("system prompt " * 20, "q")
    named["messages"][1]["name"] = 7  # not a string: copied, and serialized as JSON
    assert (
        norm.canonicalize("chat", named, IDENT).block_keys
        != norm.canonicalize("chat", plain, IDENT).block_keys
    )


def test_a_bad_identity_is_refused_on_every_request() -> None:
    import pytest

    from prompt_normalizer.errors import NormalizerError

    norm = Normalizer(NormalizerConfig(), b"s")
    bad = KeyIdentity(model_id="m", block_size_tokens=0)
    for _ in range(2):  # never cached, so never skipped
        with pytest.raises(NormalizerError) as err:
            norm.canonicalize("chat", _body("s", "q"), bad)
        assert err.value.code == "bad_config"


def test_prompt_built_by_slot_setters_equals_the_constructed_one() -> None:
    from prompt_normalizer.layout import new_prompt
    from prompt_normalizer.types import CanonicalPrompt, DriftReport, Zone, ZoneSpan

    zones = (ZoneSpan(Zone.APPEND_ONLY, "prompt", 0, 9),)
    drift = DriftReport(True, None, 1, 1)
    args = (9, 4, (1, 2), zones, (1,), ("d",), {"messages": []}, drift)
    built = new_prompt(*args)
    assert built == CanonicalPrompt(*args)
    assert type(built) is CanonicalPrompt and built.immutable_blocks == 0


def test_a_render_plan_does_not_hold_the_callers_messages() -> None:
    norm = Normalizer(NormalizerConfig(mode="render"), b"s")
    body = _body("system prompt " * 20, "q", prompt_cache_key="session-1")
    plan = norm.prepare_render("chat", body)
    assert plan.chat is not None
    assert all(a is not b for a, b in zip(plan.chat.messages, body["messages"], strict=True))
    ids = list(range(400))
    expected = Normalizer(NormalizerConfig(mode="render"), b"s").from_render(
        norm.prepare_render("chat", _body("system prompt " * 20, "q", prompt_cache_key="session-1")),
        ids,
        IDENT,
    )
    body["messages"][0]["content"] = "edited after the plan was made"
    assert norm.from_render(plan, ids, IDENT) == expected
