"""Canonical chat request: canonicalization switches, zones and volatile rules (after the checks
of `chat_input`).

Works on a private JSON copy of the request, so the caller's body is never mutated. The result is
mode independent: the approximate serializer, the local chat template and the worker's render
endpoint all start from the same `CanonicalChat`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from prompt_normalizer.chat_input import (
    Copied,
    request_flag,
    validate_messages,
    validate_template_fields,
    validate_tools,
)
from prompt_normalizer.config import NormalizerConfig, VolatileRule
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import MEDIA_PERSON, keyed_digest, keyed_hasher
from prompt_normalizer.switches import (
    Report,
    canonical_json_text,
    json_copy,
    nfc,
    normalize_whitespace,
    sort_keys,
)
from prompt_normalizer.types import Zone
from prompt_normalizer.volatile import apply_rules, text_slots

# Request fields that reach the chat template (besides messages and tools); the others (sampling,
# response_format, tool_choice, ...) are enforced at decoding and never enter the prompt.
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "documents")
_TEMPLATE_FIELD_SET = frozenset(TEMPLATE_FIELDS)
_OPTIONAL_FIELD_SET = _TEMPLATE_FIELD_SET | {
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
}


@dataclass(frozen=True, slots=True)
class FieldItem:
    """One request field in model-input order, as a keyed digest (for drift diagnostics)."""

    path: str
    zone: Zone
    digest: bytes


@dataclass(frozen=True, slots=True)
class MediaItem:
    """The multimodal parts of one message: its index and the keyed digests of their contents,
    16 bytes a part in the message's order, joined (folded into the keys of the block where the
    message starts)."""

    message_index: int
    digest: bytes


@dataclass(slots=True)
class CanonicalChat:
    """A chat request after canonicalization, ready for any rendering mode.

    `messages[:n_immutable]` form the immutable zone (with the tools when `tools_immutable`);
    `messages[volatile_index]`, when set, is the trailing message that holds the text moved out by
    volatile rules; everything between is append-only.

    Read-only once built. Not declared frozen because one is built per request and a frozen
    dataclass sets each of its twelve fields through `object.__setattr__` (about 1.3 µs a request).
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    template: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    n_immutable: int
    tools_immutable: bool
    volatile_index: int | None
    media: tuple[MediaItem, ...]
    diagnostics: tuple[str, ...]
    body: dict[str, Any] | None
    # Chat prompts: the template writes the special tokens (vLLM's default add_special_tokens=False).
    add_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class ChatRules:
    """What one `NormalizerConfig` asks of chat canonicalization (role and name sets for the
    zones, the switches), derived once per config instead of on every request."""

    unicode_nfc: bool
    whitespace: bool
    canonical_json: bool
    sort_tools: bool
    sort_properties: bool
    volatile_rules: tuple[VolatileRule, ...]
    volatile_role: str
    immutable_roles: frozenset[str]
    few_shot_names: frozenset[str]
    few_shot_messages: int
    tools_immutable: bool
    max_input_chars: int
    # Only the whitespace switch and volatile rules edit a flat text message in place; without
    # them such messages can be read where they are, with no private copy.
    edits_flat_messages: bool

    @classmethod
    def of(cls, config: NormalizerConfig) -> ChatRules:
        zones = config.zones
        return cls(
            unicode_nfc=config.unicode_nfc,
            whitespace=config.whitespace,
            canonical_json=config.canonical_json,
            sort_tools=config.tool_order == "sort",
            sort_properties=config.property_order == "sort",
            volatile_rules=config.volatile_rules,
            volatile_role=config.volatile_role,
            immutable_roles=frozenset(zones.immutable_roles),
            few_shot_names=frozenset(zones.few_shot_names),
            few_shot_messages=zones.few_shot_messages,
            tools_immutable=zones.tools_immutable,
            max_input_chars=config.max_input_chars,
            edits_flat_messages=config.whitespace or bool(config.volatile_rules),
        )


def _tool_name(tool: dict[str, Any]) -> str:
    fn = tool.get("function")
    return str(fn.get("name", "")) if isinstance(fn, dict) else str(tool.get("name", ""))


def _n_immutable(messages: list[dict[str, Any]], rules: ChatRules) -> int:
    roles, names = rules.immutable_roles, rules.few_shot_names
    few_shot_left = rules.few_shot_messages
    n = 0
    for msg in messages:
        # Roles are validated strings; a name may be any JSON value, and only a string can match.
        name = msg.get("name")
        if msg["role"] in roles or (type(name) is str and name in names):
            n += 1
        elif few_shot_left > 0:
            few_shot_left -= 1
            n += 1
        else:
            break
    return n


def _media(messages: list[dict[str, Any]], key: bytes) -> list[MediaItem]:
    """One item a message with parts other than text. Each part's digest is `keyed_digest(key,
    part, b"kvgate-media")`, taken from one keyed hasher copied per part (the key is absorbed
    once, not once a part), and a message's digests are joined here, once: its parts all fold into
    the same block."""
    items = []
    hasher = keyed_hasher(key, MEDIA_PERSON)
    sort_keys = orjson.OPT_SORT_KEYS
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if type(content) is not list:
            continue
        digests = []
        for part in content:
            if part.get("type") != "text":
                h = hasher.copy()
                h.update(orjson.dumps(part, option=sort_keys))
                digests.append(h.digest())
        if digests:
            items.append(MediaItem(i, b"".join(digests)))
    return items


# Fields a request's drift record names one by one; the rest of a longer request is one item.
MAX_FIELD_ITEMS = 1024

# The message fields a drift record names (they reach the access log's `drift_field`): the chat
# APIs' own. Any other key is the client's text, so a message's other keys are one item, named
# `OTHER_FIELDS`, whatever they are called.
NAMED_MESSAGE_FIELDS = frozenset(
    {
        "content",
        "name",
        "tool_calls",
        "tool_call_id",
        "function_call",
        "refusal",
        "audio",
        "reasoning",
        "reasoning_content",
        "thinking",
    }
)
OTHER_FIELDS = "<other fields>"


def field_items(chat: CanonicalChat, key: bytes) -> tuple[FieldItem, ...]:
    """Every request field of `chat` in model-input order, as keyed digests (drift diagnostics only,
    so computed only for requests that have a session). Past `MAX_FIELD_ITEMS` fields, what is
    left is one item (`messages[i:]` or `tools[j:]`, with everything after it): a request of
    200,000 messages costs one digest of its tail, not 400,000, and its session's record stays
    small; a drift there is named by where the tail starts."""

    def digest(value: Any) -> bytes:
        # Key order counts: with canonical_json off it reaches the model input.
        return keyed_digest(key, orjson.dumps(value))

    msgs, n_imm, volatile_index = chat.messages, chat.n_immutable, chat.volatile_index
    tools: list[Any] = list(chat.tools or ())
    tools_zone = Zone.IMMUTABLE if chat.tools_immutable else Zone.APPEND_ONLY
    items = [FieldItem("template", Zone.IMMUTABLE, digest(chat.template))]

    def zone_of(i: int) -> Zone:
        return Zone.IMMUTABLE if i < n_imm else Zone.VOLATILE if i == volatile_index else Zone.APPEND_ONLY

    def messages(lo: int, hi: int, after: list[Any]) -> bool:
        """Add messages lo … hi − 1; False once the budget is spent (the rest, from the next
        message on and then `after`, added as one item)."""
        for i in range(lo, hi):
            if len(items) >= MAX_FIELD_ITEMS:
                items.append(FieldItem(f"messages[{i}:]", zone_of(i), digest([msgs[i:hi], *after])))
                return False
            zone = zone_of(i)
            message = msgs[i]
            items.append(FieldItem(f"messages[{i}].role", zone, digest(message.get("role"))))
            other: dict[str, Any] = {}
            for name in sorted(k for k in message if k != "role"):
                if name in NAMED_MESSAGE_FIELDS:
                    items.append(FieldItem(f"messages[{i}].{name}", zone, digest(message[name])))
                else:
                    other[name] = message[name]
            if other:
                items.append(FieldItem(f"messages[{i}].{OTHER_FIELDS}", zone, digest(other)))
        return True

    if not messages(0, n_imm, [tools, msgs[n_imm:]]):
        return tuple(items)
    for j, tool in enumerate(tools):
        if len(items) >= MAX_FIELD_ITEMS:
            items.append(FieldItem(f"tools[{j}:]", tools_zone, digest([tools[j:], msgs[n_imm:]])))
            return tuple(items)
        items.append(FieldItem(f"tools[{j}]", tools_zone, digest(tool)))
    messages(n_imm, len(msgs), [])
    return tuple(items)


def _apply_switches(
    messages: list[dict[str, Any]],
    copied_messages: Copied,
    tools: list[dict[str, Any]] | None,
    copied_tools: Copied | None,
    rules: ChatRules,
    report: Report,
) -> list[dict[str, Any]] | None:
    """The canonicalization switches, in place on the private copies; returns the tools (reordered
    when sorted)."""
    if rules.unicode_nfc and not copied_messages.ascii:
        for i, msg in enumerate(messages):
            messages[i], changed = nfc(msg)
            if changed:
                report.add(f"unicode_nfc: changed messages[{i}]")
    if rules.unicode_nfc and copied_tools is not None and not copied_tools.ascii:
        for j, tool in enumerate(tools or ()):
            tools[j], changed = nfc(tool)  # type: ignore[index]
            if changed:
                report.add(f"unicode_nfc: changed tools[{j}]")
    if rules.whitespace:
        for i, msg in enumerate(messages):
            for suffix, container, k in text_slots(msg):
                new = normalize_whitespace(container[k])
                if new != container[k]:
                    container[k] = new
                    report.add(f"whitespace: changed messages[{i}].{suffix}")
    if rules.canonical_json:
        for j, tool in enumerate(tools or ()):
            tools[j], changed = sort_keys(tool, sort_all=rules.sort_properties)  # type: ignore[index]
            if changed:
                report.add(f"canonical_json: reordered keys of tools[{j}]")
        if copied_messages.structured:
            for i, msg in enumerate(messages):
                if "tool_calls" in msg or msg["role"] == "tool":
                    _canonical_structured(msg, i, report)
    if tools and rules.sort_tools:
        ordered = sorted(tools, key=lambda t: (_tool_name(t), orjson.dumps(t, option=orjson.OPT_SORT_KEYS)))
        if ordered != tools:
            tools = ordered
            report.add(f"tool_order: sorted {len(tools)} tools by name")
    return tools


def canonicalize_chat(
    body: Mapping[str, Any], config: NormalizerConfig | ChatRules, key: bytes
) -> CanonicalChat:
    """Validate and canonicalize a chat request; raises NormalizerError on bad input.

    Callers on the request path pass the config's `ChatRules` (derived once, kept by the
    `Normalizer`) rather than the config itself."""
    rules = config if isinstance(config, ChatRules) else ChatRules.of(config)
    copied_messages = validate_messages(body.get("messages"), rules.edits_flat_messages, rules.unicode_nfc)
    raw_tools = body.get("tools")
    copied_tools = validate_tools(raw_tools) if raw_tools is not None else None
    messages: list[dict[str, Any]] = copied_messages.value
    tools: list[dict[str, Any]] | None = copied_tools.value if copied_tools is not None else None
    size = copied_messages.n_bytes + (copied_tools.n_bytes if copied_tools is not None else 0)
    if size > rules.max_input_chars:
        raise NormalizerError(
            "prompt is larger than this pool accepts", param="messages", code="input_too_large"
        )
    template: dict[str, Any] = {}
    add_generation_prompt, continue_final_message, add_special_tokens = True, False, False
    if not _OPTIONAL_FIELD_SET.isdisjoint(body):  # most requests set none of these
        if not _TEMPLATE_FIELD_SET.isdisjoint(body):
            validate_template_fields(body)
            for name in TEMPLATE_FIELDS:
                if body.get(name) is not None:
                    template[name] = json_copy(body[name], name)
        add_generation_prompt = request_flag(body, "add_generation_prompt", True)
        continue_final_message = request_flag(body, "continue_final_message", False)
        add_special_tokens = request_flag(body, "add_special_tokens", False)

    moved: list[str] = []
    report = None
    # Flat messages read in place and no tools: no switch and no rule can apply. (With tools, the
    # switches still leave such messages alone: see `_flat` and `ChatRules.edits_flat_messages`.)
    if copied_messages.private or tools is not None:
        report = Report()
        tools = _apply_switches(messages, copied_messages, tools, copied_tools, rules, report)
        if rules.volatile_rules:
            apply_rules(rules.volatile_rules, messages, moved, report)
    n_imm = _n_immutable(messages, rules)
    volatile_index = None
    if moved:
        volatile_index = len(messages)
        messages.append({"role": rules.volatile_role, "content": "\n".join(moved)})
    canonical_body = None
    if report is not None and report.changed:
        if not copied_messages.private:
            # The caller's flat messages (see _flat): a shallow copy of each is a deep one.
            messages = [dict(msg) for msg in messages]
        canonical_body = dict(body)
        canonical_body["messages"] = messages
        if tools is not None:
            canonical_body["tools"] = tools
    # Positional (field order of CanonicalChat): a dataclass __init__ with keywords costs ~2.5x.
    return CanonicalChat(
        tuple(messages),
        tuple(tools) if tools else None,
        template,
        add_generation_prompt,
        continue_final_message,
        n_imm,
        rules.tools_immutable,
        volatile_index,
        tuple(_media(messages, key)) if copied_messages.has_parts else (),
        report.done() if report is not None else (),
        canonical_body,
        add_special_tokens,
    )


def _canonical_structured(msg: dict[str, Any], i: int, report: Report) -> None:
    """Canonical JSON of structured content: tool-call arguments and JSON tool results."""
    for j, call in enumerate(msg.get("tool_calls") or ()):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            new = canonical_json_text(fn["arguments"])
            if new is not None and new != fn["arguments"]:
                fn["arguments"] = new
                report.add(f"canonical_json: rewrote messages[{i}].tool_calls[{j}].function.arguments")
    if msg["role"] == "tool":
        for suffix, container, k in text_slots(msg):
            new = canonical_json_text(container[k])
            if new is not None and new != container[k]:
                container[k] = new
                report.add(f"canonical_json: rewrote messages[{i}].{suffix}")
