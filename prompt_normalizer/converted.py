"""A request of another API (Responses, Anthropic Messages) as the chat request its worker renders.

vLLM serves both APIs by converting the request into chat messages and rendering them with the
model's chat template, so the normalizer keys them the same way: an input adapter per API
(`responses_input.py`, `messages_input.py`) builds the chat body, and the chat machinery
(canonical form, zones, every rendering mode, keys) does the rest. The body the worker receives
is the client's own (the gateway forwards it as sent), so no canonicalization switch or volatile
rule edits a converted request: its keys describe it as the worker will render it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from prompt_normalizer.canonical import CanonicalChat, ChatRules, canonicalize_chat
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.types import CanonicalPrompt


@dataclass(frozen=True, slots=True)
class ConvertedChat:
    """A chat body (`messages`, `tools`, `add_generation_prompt`) built from another API's request.

    `sources[i]` is the request path chat message `i` came from (`instructions`, `input[3]`,
    `system`, `messages[2]`), so drift reports name the client's own fields. `n_immutable` and
    `tools_immutable`, when set, are an explicit zone boundary the request carries (Anthropic
    `cache_control`) and replace the pool's zone rules. `messages` may be empty (a Responses
    follow-up without instructions: everything before its new input is the worker's).
    """

    body: dict[str, Any]
    sources: tuple[str, ...]
    n_immutable: int | None = None
    tools_immutable: bool | None = None
    diagnostics: tuple[str, ...] = field(default=())


_MESSAGE_PATH = re.compile(r"messages\[(\d+)\](.*)", re.DOTALL)


def relabel_drift(prompt: CanonicalPrompt, sources: tuple[str, ...]) -> CanonicalPrompt:
    """The prompt with its drift report naming the request's own field instead of the converted
    chat message (`messages[1].content` → `input[0].content`)."""
    drift = prompt.drift
    if drift is None or drift.field is None:
        return prompt
    match = _MESSAGE_PATH.fullmatch(drift.field)
    if match is None or int(match.group(1)) >= len(sources):
        return prompt
    return replace(prompt, drift=replace(drift, field=sources[int(match.group(1))] + match.group(2)))


def relabel_error(exc: NormalizerError, sources: tuple[str, ...]) -> NormalizerError:
    """`exc` naming the request's own field instead of the converted chat's (`messages[1].content`
    → `input[0].content`; `messages` as a whole → the field the last message came from)."""
    param = exc.param
    if param is None or not sources:
        return exc
    match = _MESSAGE_PATH.fullmatch(param)
    if match is not None and int(match.group(1)) < len(sources):
        param = sources[int(match.group(1))] + match.group(2)
    elif param == "messages":
        param = sources[-1].split("[", 1)[0]
    else:
        return exc
    return NormalizerError(exc.message, param=param, code=exc.code)


def no_edit_rules(rules: ChatRules) -> ChatRules:
    """The pool's chat rules with every switch and volatile rule off: a converted request is
    forwarded as the client sent it, so nothing may change what its keys describe."""
    return replace(
        rules,
        unicode_nfc=False,
        whitespace=False,
        canonical_json=False,
        sort_tools=False,
        volatile_rules=(),
        edits_flat_messages=False,
    )


def converted_canonical(converted: ConvertedChat, rules: ChatRules, key: bytes) -> CanonicalChat:
    """The canonical chat of a converted request (`rules` from `no_edit_rules`), with the
    request's explicit zone boundary, if it carries one."""
    try:
        chat = canonicalize_chat(converted.body, rules, key)
    except NormalizerError as exc:
        raise relabel_error(exc, converted.sources) from None
    changes: dict[str, Any] = {}
    if converted.n_immutable is not None:
        changes["n_immutable"] = min(converted.n_immutable, len(chat.messages))
    if converted.tools_immutable is not None:
        changes["tools_immutable"] = converted.tools_immutable
    if converted.diagnostics:
        changes["diagnostics"] = (*converted.diagnostics, *chat.diagnostics)
    return replace(chat, **changes) if changes else chat
