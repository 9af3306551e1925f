"""Drift records: where a session's prefix first changed (block, zone, field), never its content,
named up to a bound, and bounded in memory."""

from __future__ import annotations

from prompt_normalizer.canonical import MAX_FIELD_ITEMS
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity, Zone
from tests.prompt_normalizer.messages import IDENT, assistant, chat, sys_msg, user


def test_drift_names_block_zone_and_field_without_content() -> None:
    norm = Normalizer(NormalizerConfig(canonical_json=False), b"s")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    first = norm.canonicalize("chat", chat(sys_msg(), user("q1"), tools=tools, user="u-1"), IDENT)
    assert first.drift is not None and not first.drift.session_seen
    extended = norm.canonicalize(
        "chat", chat(sys_msg(), user("q1"), assistant("a1"), user("q2"), tools=tools, user="u-1"), IDENT
    )
    assert (
        extended.drift is not None and extended.drift.session_seen and extended.drift.first_diff_block is None
    )
    shuffled = [{"type": "function", "function": {"name": "f", "parameters": {"a": 2, "b": 1}}}]
    drifted = norm.canonicalize(
        "chat", chat(sys_msg(), user("q1"), assistant("a1"), user("q2"), tools=shuffled, user="u-1"), IDENT
    )
    report = drifted.drift
    assert report is not None and report.first_diff_block is not None
    assert report.zone is Zone.IMMUTABLE and report.field == "tools[0]"
    assert report.shared_blocks == report.first_diff_block < report.previous_blocks
    assert any(d.startswith("drift: block") for d in drifted.diagnostics)
    # Another tenant with the same session key is another session.
    other = norm.canonicalize("chat", chat(sys_msg(), user("q1"), user="u-1"), KeyIdentity(model_id="m"))
    assert other.drift is not None and not other.drift.session_seen
    # A header session key wins over body fields.
    by_header = norm.canonicalize("chat", chat(sys_msg(), user("q1")), IDENT, session_key="hdr")
    assert by_header.drift is not None and not by_header.drift.session_seen


def test_drift_never_names_a_message_key_the_client_made_up() -> None:
    # A message's keys are the client's text when they are not the chat APIs' own: the drift
    # record (the access log's `drift_field`) names them together, never by their name.
    norm = Normalizer(NormalizerConfig(canonical_json=False), b"s")
    secret = "ZEBRAKEY my secret prompt text in a key " + "K" * 5000
    first = norm.canonicalize("chat", chat({**sys_msg(), secret: "v"}, user("q1"), user="u-k"), IDENT)
    assert first.drift is not None and not first.drift.session_seen
    body = chat({**sys_msg("other"), secret: "v"}, user("q1"), user="u-k")
    changed = norm.canonicalize("chat", body, IDENT)
    report = changed.drift
    assert report is not None and report.first_diff_block is not None
    assert report.field == "messages[0].content"
    assert not any("ZEBRA" in d for d in changed.diagnostics)
    # A change of the made-up key's value is named as the message's other fields.
    norm.canonicalize("chat", chat({**sys_msg(), "extra": "v1"}, user("q1"), user="u-x"), IDENT)
    moved = norm.canonicalize("chat", chat({**sys_msg(), "extra": "v2"}, user("q1"), user="u-x"), IDENT).drift
    assert moved is not None and moved.first_diff_block is not None
    assert moved.field == "messages[0].<other fields>"


def test_a_long_sessions_fields_are_named_up_to_a_bound_then_by_where_its_tail_starts() -> None:
    norm = Normalizer(NormalizerConfig(canonical_json=False), b"s")
    turns = [user(f"q{i}") if i % 2 else assistant(f"a{i}") for i in range(3 * MAX_FIELD_ITEMS)]
    first = norm.canonicalize("chat", chat(sys_msg(), *turns, user="u-long"), IDENT)
    assert first.drift is not None and not first.drift.session_seen
    # A change far past the bound is named by the tail it falls in: the template, then two fields
    # (role, content) a message up to the bound.
    changed = [*turns[: 2 * MAX_FIELD_ITEMS], user("changed"), *turns[2 * MAX_FIELD_ITEMS + 1 :]]
    report = norm.canonicalize("chat", chat(sys_msg(), *changed, user="u-long"), IDENT).drift
    assert report is not None and report.first_diff_block is not None
    assert report.field == f"messages[{(MAX_FIELD_ITEMS - 1 + 1) // 2}:]"
    # One within the bound is still named by its field.
    early = [assistant("changed early"), *turns[1:]]
    report = norm.canonicalize("chat", chat(sys_msg(), *early, user="u-long"), IDENT).drift
    assert report is not None and report.field == "messages[1].content"


def test_drift_memory_is_bounded() -> None:
    norm = Normalizer(NormalizerConfig(drift_sessions_max=3, drift_store_max_blocks=10_000), b"s")
    for i in range(10):
        norm.canonicalize("completions", {"prompt": list(range(64)), "user": f"u{i}"}, IDENT)
    assert norm.drift_sessions == 3
    small = Normalizer(NormalizerConfig(drift_store_max_blocks=40), b"s")
    for i in range(5):
        small.canonicalize("completions", {"prompt": list(range(64)), "user": f"u{i}"}, IDENT)
    assert small.drift_sessions == 2  # 16 blocks each, at most 40 stored
