"""Behaviour of the facade: zones, volatile rules, switches, completions, render mode, errors (drift
records: test_drift.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from prompt_normalizer.config import VolatileRule, ZoneConfig
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.render import parse_render_token_ids
from prompt_normalizer.template import ChatTemplateTokenizer
from prompt_normalizer.types import KeyIdentity, Zone
from tests.prompt_normalizer.messages import IDENT, SYSTEM, assistant, chat, sys_msg, user


def test_zones_immutable_roles_and_few_shot() -> None:
    cfg = NormalizerConfig(zones=ZoneConfig(few_shot_messages=2))
    body = chat(sys_msg(), user("example q"), assistant("example a"), user("real"))
    prompt = Normalizer(cfg, b"s").canonicalize("chat", body, IDENT)
    assert [z.zone for z in prompt.zones] == [Zone.IMMUTABLE, Zone.APPEND_ONLY]
    assert prompt.zones[0].source == "messages[0:3]"
    named = chat(
        sys_msg(), user("q", name="example_user"), assistant("a", name="example_assistant"), user("real")
    )
    assert (
        Normalizer(NormalizerConfig(), b"s").canonicalize("chat", named, IDENT).zones[0].source
        == "messages[0:3]"
    )
    # A system message after the first real turn is conversation, not immutable.
    late = chat(user("hi"), sys_msg("late"))
    assert [z.zone for z in Normalizer(NormalizerConfig(), b"s").canonicalize("chat", late, IDENT).zones] == [
        Zone.APPEND_ONLY
    ]


def test_appending_a_turn_keeps_all_earlier_full_blocks() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    one = norm.canonicalize("chat", chat(sys_msg(), user("q1")), IDENT)
    two = norm.canonicalize("chat", chat(sys_msg(), user("q1"), assistant("a1"), user("q2")), IDENT)
    stable = one.zones[-1].end_token // 4 - 1  # the generation marker may sit in the last block
    assert two.block_keys[:stable] == one.block_keys[:stable]


@pytest.mark.parametrize("action", ["move_to_end", "drop", "keep_and_warn"])
def test_pattern_rule_actions(action: str) -> None:
    rule = VolatileRule(name="ts", pattern=r"time=\d+", roles=("system",), action=action)  # type: ignore[arg-type]
    norm = Normalizer(NormalizerConfig(volatile_rules=(rule,)), b"s")
    a = norm.canonicalize("chat", chat(sys_msg("time=1 " + SYSTEM), user("q")), IDENT)
    b = norm.canonicalize("chat", chat(sys_msg("time=2 " + SYSTEM), user("q")), IDENT)
    if action == "keep_and_warn":
        assert a.block_keys[0] != b.block_keys[0]
        assert a.diagnostics == (
            "volatile 'ts' kept in place (prefix may break): messages[0].content, 1 match(es)",
        )
        assert a.canonical_body is None
        return
    assert a.diagnostics == (f"volatile 'ts' {action}: messages[0].content, 1 match(es)",)
    assert a.canonical_body is not None and "time=1" not in a.canonical_body["messages"][0]["content"]
    if action == "drop":
        assert a.block_keys == b.block_keys
        assert len(a.canonical_body["messages"]) == 2
    else:
        assert a.zones[-1].zone is Zone.VOLATILE
        assert a.canonical_body["messages"][-1] == {"role": "system", "content": "time=1"}
        stable = a.zones[-1].start_token // 4
        assert a.block_keys[:stable] == b.block_keys[:stable] and stable > 0


def test_field_rule_before_last_user_drops_earlier_reasoning_only() -> None:
    rule = VolatileRule(
        name="r", field="reasoning_content", roles=("assistant",), scope="before_last_user", action="drop"
    )
    norm = Normalizer(NormalizerConfig(volatile_rules=(rule,)), b"s")
    body = chat(
        sys_msg(),
        user("q1"),
        assistant("a1", reasoning_content="old"),
        user("q2"),
        assistant("a2", reasoning_content="current"),
    )
    prompt = norm.canonicalize("chat", body, IDENT)
    assert prompt.diagnostics == ("volatile 'r' drop: messages[2].reasoning_content",)
    assert prompt.canonical_body is not None
    assert "reasoning_content" not in prompt.canonical_body["messages"][2]
    assert prompt.canonical_body["messages"][4]["reasoning_content"] == "current"


def test_switches_reported_only_when_they_change_something() -> None:
    cfg = NormalizerConfig(whitespace=True, tool_order="sort")
    norm = Normalizer(cfg, b"s")
    tools = [{"function": {"name": n, "parameters": {}}, "type": "function"} for n in ("b", "a")]
    clean = norm.canonicalize("chat", chat(sys_msg("x"), user("café"), tools=tools[::-1]), IDENT)
    assert clean.diagnostics == () and clean.canonical_body is None
    messy = chat(sys_msg("x  \r\n"), user("cafe\u0301"), tools=tools)
    prompt = norm.canonicalize("chat", messy, IDENT)
    assert set(prompt.diagnostics) == {
        "unicode_nfc: changed messages[1]",
        "whitespace: changed messages[0].content",
        "tool_order: sorted 2 tools by name",
    }
    assert prompt.block_keys == clean.block_keys


def test_canonical_json_off_keeps_structured_content() -> None:
    body = chat(
        user("q"),
        assistant(
            "",
            tool_calls=[
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}
            ],
        ),
    )
    on = Normalizer(NormalizerConfig(), b"s").canonicalize("chat", body, IDENT)
    off = Normalizer(NormalizerConfig(canonical_json=False), b"s").canonicalize("chat", body, IDENT)
    assert on.canonical_body is not None
    assert on.canonical_body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":1}'
    assert off.canonical_body is None and off.diagnostics == ()


def test_completions_forms() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    ids = list(range(10))
    assert norm.canonicalize("completions", {"prompt": ids}, IDENT).n_tokens == 10
    assert (
        len(norm.canonicalize("completions", {"prompt": ids}, IDENT).block_keys) == 2
    )  # partial tail unkeyed
    batch = norm.canonicalize("completions", {"prompt": [ids, [1, 2]]}, IDENT)
    assert batch.diagnostics == ("prompt: batch of 2 prompts, keyed by prompt[0]",)
    text = norm.canonicalize("completions", {"prompt": "x" * 40}, IDENT)
    assert text.n_tokens == 10 and [z.zone for z in text.zones] == [Zone.APPEND_ONLY]
    assert norm.canonicalize("completions", {"prompt": ["x" * 40]}, IDENT).block_keys == text.block_keys
    assert (
        norm.keys_for_tokens(ids, IDENT)
        == norm.canonicalize("completions", {"prompt": ids}, IDENT).block_keys
    )
    keys = norm.keys_for_tokens(ids, IDENT)
    assert norm.keys_for_tokens(ids[4:8], IDENT, parent=keys[0]) == keys[1:2]  # KV-event style chaining


def test_short_prompt_has_no_keys() -> None:
    prompt = Normalizer(NormalizerConfig(), b"s").canonicalize("completions", {"prompt": [1, 2, 3]}, IDENT)
    assert prompt.n_tokens == 3 and prompt.block_keys == ()


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("chat", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        ("completions", {"prompt": {"a": 1}}, "prompt"),
        ("completions", {"prompt": [1, -2]}, "prompt"),
        ("completions", {"prompt": [1, 2**33]}, "prompt"),
    ],
)
def test_bad_input_is_a_clear_error(endpoint: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(NormalizerError) as err:
        Normalizer(NormalizerConfig(), b"s").canonicalize(endpoint, body, IDENT)  # type: ignore[arg-type]
    assert err.value.param == param


def test_config_rejects_bad_rules_and_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        VolatileRule(name="x", field="a", pattern="b")
    with pytest.raises(ValidationError):
        VolatileRule(name="x", pattern="(")
    with pytest.raises(ValidationError):
        VolatileRule(name="x", pattern="a*")
    with pytest.raises(ValidationError):
        NormalizerConfig.model_validate({"mode": "tokenizer"})
    with pytest.raises(ValidationError):
        NormalizerConfig.model_validate({"canonical_jsn": True})


def test_media_identity_is_folded_from_its_message_on() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")

    def body(url: str) -> dict[str, Any]:
        parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
        return chat(sys_msg(), user("first question " * 4), {"role": "user", "content": parts})

    a = norm.canonicalize("chat", body("https://example.invalid/a.png"), IDENT)
    b = norm.canonicalize("chat", body("https://example.invalid/b.png"), IDENT)
    first_diff = next(i for i, (x, y) in enumerate(zip(a.block_keys, b.block_keys, strict=True)) if x != y)
    assert first_diff > 0 and a.n_tokens == b.n_tokens
    assert not set(a.block_keys[first_diff:]) & set(b.block_keys)


def _tool_body() -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "a": 1}}}
    ]
    return chat(
        sys_msg("You are a careful assistant."),
        user("Weather?"),
        assistant("It is sunny."),
        user("Thanks"),
        tools=tools,
    )


def test_render_mode_matches_tokenizer_mode(tiny_model_dir: Path) -> None:
    """A worker that renders with the same template yields the same keys and spans via from_render."""
    rule = VolatileRule(name="clock", pattern=r"\d\d:\d\d", roles=("user",))
    local = Normalizer(
        NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir), volatile_rules=(rule,)), b"s"
    )
    remote = Normalizer(NormalizerConfig(mode="render", volatile_rules=(rule,)), b"s")
    worker = ChatTemplateTokenizer(str(tiny_model_dir))
    body = _tool_body()
    body["messages"][3]["content"] = "Thanks, it is 10:42"

    def render(request: dict[str, Any]) -> dict[str, Any]:
        canon = Normalizer(NormalizerConfig(mode="render", canonical_json=False), b"x").prepare_render(
            "chat", request
        )
        assert canon.chat is not None
        return {
            "token_ids": worker.encode(
                worker.render(canon.chat), add_special_tokens=False, with_offsets=False
            ).tokens.tolist()
        }

    with pytest.raises(NormalizerError) as err:
        remote.canonicalize("chat", body, IDENT)
    assert err.value.code == "render_required"
    plan = remote.prepare_render("chat", body)
    assert plan.render_path == "/v1/chat/completions/render"
    full = parse_render_token_ids(render(dict(plan.body)))
    bounds = [None if b is None else parse_render_token_ids(render(dict(b))) for b in plan.boundary_bodies]
    via_render = remote.from_render(plan, full, IDENT, boundary_token_ids=bounds)
    via_local = local.canonicalize("chat", body, IDENT)
    assert via_render.block_keys == via_local.block_keys
    assert via_render.zones == via_local.zones
    assert [z.zone for z in via_render.zones] == [Zone.IMMUTABLE, Zone.APPEND_ONLY, Zone.VOLATILE]
    # Without boundary renders the keys are the same and the zones conservative.
    bare = remote.from_render(plan, full, IDENT)
    assert bare.block_keys == via_local.block_keys
    assert [z.zone for z in bare.zones] == [Zone.APPEND_ONLY]


def test_parse_render_shapes() -> None:
    assert parse_render_token_ids({"token_ids": [1, 2]}).tolist() == [1, 2]
    assert parse_render_token_ids([{"token_ids": [3]}]).tolist() == [3]
    for bad in ({}, [], {"token_ids": "x"}, {"token_ids": [1, "a"]}):
        with pytest.raises(NormalizerError):
            parse_render_token_ids(bad)


def test_tokenizer_mode_completions_text(tiny_model_dir: Path) -> None:
    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tiny_model_dir)), b"s")
    prompt = norm.canonicalize(
        "completions", {"prompt": "The quick brown fox jumps over the lazy dog."}, IDENT
    )
    assert prompt.n_tokens > 4 and len(prompt.block_keys) == prompt.n_tokens // 4
    assert norm.render_fingerprint is not None and len(norm.render_fingerprint) == 16


def test_token_hasher_gives_request_keys_for_event_blocks() -> None:
    norm = Normalizer(NormalizerConfig(), b"s")
    ids = list(range(100, 124))
    keys = norm.keys_for_tokens(ids, IDENT)
    hasher = norm.token_hasher(KeyIdentity(model_id="m", block_size_tokens=4))
    parent = hasher.root("t1", None)
    chained = []
    for start in range(0, 24, 4):
        parent = hasher.chain(parent, ids[start : start + 4])
        chained.append(parent)
    assert tuple(chained) == keys
    assert hasher.root("t1", "lora-a") != hasher.root("t1", None) != hasher.root("t2", None)


def test_an_event_without_lora_name_comes_from_the_base_model() -> None:
    # The adapter of an event's root is the event's `lora_name` alone: a hasher built on an
    # adapter's identity still keys an event without one as the base model's.
    norm = Normalizer(NormalizerConfig(), b"s")
    base = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4)
    sql = KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4, adapter="sql-lora")
    for built_on in (base, sql):
        hasher = norm.token_hasher(built_on)
        assert hasher.root("t1", None) == norm.root(base)
        assert hasher.root("t1", "sql-lora") == norm.root(sql)
    assert norm.root(base) != norm.root(sql)


def _model_dir(tmp: Path, template: str | list[dict[str, str]]) -> str:
    import json
    import shutil

    from tests.prompt_normalizer.tiny_model import build_tiny_model

    base = tmp / "base"
    if not base.exists():
        build_tiny_model(base)
    target = tmp / f"m{len(list(tmp.iterdir()))}"
    target.mkdir()
    shutil.copy(base / "tokenizer.json", target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(target)


def test_template_that_refuses_a_boundary_leaves_zone_empty(tmp_path: Path) -> None:
    # Tools go into the first user message, so "system + tools" alone cannot be rendered.
    template = (
        "{% for m in messages %}{% if m.role == 'user' and tools and loop.index0 == 1 %}"
        "<|im_start|>user\n{{ tools | tojson }} {{ m.content }}<|im_end|>\n"
        "{% elif m.role == 'system' and tools and messages | length == 1 %}"
        "{{ raise_exception('tools need a user message') }}"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=_model_dir(tmp_path, template)), b"s")
    body = chat(sys_msg("Be brief."), user("hello"), tools=[{"type": "function", "function": {"name": "f"}}])
    prompt = norm.canonicalize("chat", body, IDENT)
    assert [z.zone for z in prompt.zones] == [Zone.APPEND_ONLY]
    assert "zones: immutable boundary not measured; immutable zone left empty" in prompt.diagnostics
    assert prompt.zones[0].source == "messages[0:2]" and prompt.zones[0].start_token == 0
    assert prompt.public_block_keys == () and prompt.block_keys


def test_tool_use_template_and_continue_final_message(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
        {
            "name": "tool_use",
            "template": "TOOLS {{ tools | length }}\n{% for m in messages %}{{ m.content }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        },
    ]
    norm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=_model_dir(tmp_path, templates)), b"s")
    tokenizer = ChatTemplateTokenizer(_model_dir(tmp_path, templates))
    from prompt_normalizer.canonical import canonicalize_chat

    with_tools = canonicalize_chat(
        chat(user("hi"), tools=[{"type": "function", "function": {"name": "f"}}]), norm.config, b"k" * 32
    )
    assert tokenizer.render(with_tools) == "TOOLS 1\nhi\n<|im_start|>assistant\n"
    plain = canonicalize_chat(chat(user("hi"), assistant("The answer is")), norm.config, b"k" * 32)
    assert tokenizer.render(plain) == "user: hi\nassistant: The answer is\n"
    prefill = canonicalize_chat(
        chat(
            user("hi"), assistant("The answer is"), continue_final_message=True, add_generation_prompt=False
        ),
        norm.config,
        b"k" * 32,
    )
    assert tokenizer.render(prefill) == "user: hi\nassistant: The answer is"


def test_generation_blocks_render_transparently(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    tokenizer = ChatTemplateTokenizer(_model_dir(tmp_path, template))
    from prompt_normalizer.canonical import canonicalize_chat

    chat_ = canonicalize_chat(chat(user("hi"), assistant("yo")), NormalizerConfig(), b"k" * 32)
    assert tokenizer.render(chat_) == "user: hiassistant: yo"  # trim_blocks eats the newline after a tag
