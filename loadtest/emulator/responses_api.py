"""The OpenAI Responses API as vLLM serves it: requests to prompts, response objects, events.

A request's prompt is the chat rendering of `instructions` (as a system message), the stored
conversation of `previous_response_id` (its inputs and outputs, not its instructions), and the new
`input` items. So a follow-up that keeps its instructions starts with the previous prompt and
answer, and hits the prefix cache like the next turn of a chat. Like vLLM, responses are kept in
this process only (bounded here: the oldest are dropped beyond `RESPONSE_STORE_LIMIT`); an
unknown or dropped `previous_response_id` is a 404. A `background` request is answered at once
with its object `queued` and runs on (`routes_responses.py`, `background.py`).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.emulator.chat_template import render_chat
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError, RequestValidationError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.logprobs import chat_logprobs
from loadtest.emulator.protocol import (
    GenerationRequest,
    bool_field,
    check_sampling,
    common_fields,
    int_field,
    logprobs_limit,
    one_answer_request,
    stop_rule,
    tool_call_for,
)
from loadtest.emulator.web import named_event
from loadtest.engine.tokenizer import Tokenizer

RESPONSE_STORE_LIMIT = 10_000
_TEXT_PARTS = ("input_text", "output_text", "text")
# The values vLLM's `ResponsesRequest.include` accepts (a `Literal`); only the logprobs one changes
# what it answers (the output text's logprobs, `top_logprobs` alternatives per token).
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response and the conversation (chat messages, no instructions) it ended."""

    body: dict[str, Any]
    history: tuple[dict[str, Any], ...]


class ResponseStore:
    """Responses kept by this server, least recently stored dropped first beyond `limit`."""

    def __init__(self, limit: int = RESPONSE_STORE_LIMIT) -> None:
        self._limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for an id it does not hold."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """A validated Responses request: what to generate and what the response object echoes."""

    gen: GenerationRequest
    response_id: str
    history: tuple[dict[str, Any], ...]  # the conversation including the new input
    store: bool
    echo: dict[str, Any]
    background: bool = False  # run after the answer (`background.py`); its object is stored queued


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError.bad_request("content must be a string or a list of parts", where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ApiError.bad_request(
                "parts must be input_text, output_text or input_image (with image_url)", f"{where}[{j}]"
            )
    return parts


def input_messages(value: Any) -> list[dict[str, Any]]:
    """Responses `input` (a string or a list of items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError.bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"name": item["name"], "arguments": str(item.get("arguments", ""))}
            out.append(
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": str(item.get("call_id", "")), "type": "function", "function": call}]}
            )  # fmt: skip
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else orjson.dumps(output).decode()
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            continue  # not part of the prompt, as in vLLM
        else:
            raise ApiError.bad_request(
                "items must be messages, function_call or function_call_output items", where
            )
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) in the chat shape the template and tool chooser use. Other
    tools (`web_search_preview`, `mcp`, `custom`, ...) are taken and left out, as vLLM renders
    only function tools (`construct_tool_dicts`) and runs built-in ones only with a tool server."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError.bad_request("tools must be a list", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise ApiError.bad_request("each tool must be an object with a type", f"tools[{i}]")
        if tool["type"] != "function":
            continue
        if not isinstance(tool.get("name"), str):
            raise ApiError.bad_request("a function tool needs a name", f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _check_include(value: Any) -> None:
    """`include`: null, or a list of `INCLUDABLE` values."""
    if value is None:
        return
    if not isinstance(value, list):
        raise RequestValidationError(
            {"type": "list_type", "loc": ("body", "include"), "msg": "Input should be a valid list",
             "input": value}
        )  # fmt: skip
    expected = ", ".join(repr(v) for v in INCLUDABLE[:-1]) + f" or {INCLUDABLE[-1]!r}"
    for i, item in enumerate(value):
        if item not in INCLUDABLE:
            raise RequestValidationError(
                {"type": "literal_error", "loc": ("body", "include", i), "msg": f"Input should be {expected}",
                 "input": item, "ctx": {"expected": expected}}
            )  # fmt: skip


def parse_responses(
    body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer, store: ResponseStore
) -> ResponsesCall:
    _check_include(body.get("include"))  # vLLM validates the whole body before looking at it
    common = common_fields(body, cfg)
    check_sampling(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError.bad_request("instructions must be a string", "instructions")
    previous_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if previous_id is not None:
        previous = store.get(previous_id) if isinstance(previous_id, str) else None
        if previous is None:
            raise not_found(str(previous_id))
        history.extend(previous.history)
    history.extend(input_messages(body.get("input")))
    tools = _chat_tools(body.get("tools"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    prompt = tokenizer.encode(render_chat(messages, tools))
    tool = tool_call_for(tools, _chat_tool_choice(body.get("tool_choice")), history)
    max_tokens = int_field(body, "max_output_tokens", 1) or cfg.default_max_tokens
    logprobs = None
    if INCLUDE_LOGPROBS in (body.get("include") or ()) and body.get("top_logprobs", 0) is not None:
        # vLLM samples with `logprobs=top_logprobs` then: none for an explicit null.
        logprobs = logprobs_limit(int_field(body, "top_logprobs", 0) or 0, "top_logprobs")
    # vLLM's Responses request takes `stop` and `include_stop_str_in_output` as chat does.
    stop = stop_rule(body, 0)
    gen = one_answer_request("responses", common, prompt, max_tokens, tool, stop, logprobs=logprobs)
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), Mapping) else None,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": previous_id,
        "temperature": _number(body, "temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": logprobs,  # vLLM echoes its sampling logprobs: null unless included
        "top_p": _number(body, "top_p", 1.0),
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    rid = common.request_id or f"resp_{uuid.uuid4().hex}"
    keep = bool_field(body, "store", True)
    return ResponsesCall(gen, rid, tuple(history), keep, echo, bool_field(body, "background"))


def item_id(prefix: str, group: LiveGroup) -> str:
    """A stable id for the output item of a group (the same in events and the final object)."""
    return f"{prefix}_{group.lives[0].request_id}"


def output_item(group: LiveGroup, status: str, text: str) -> dict[str, Any]:
    """The one output item: a message with `output_text` (its tokens' logprobs once completed,
    when `include` asked for them; null when not, as vLLM's `_make_response_output_items`
    leaves them), or a `function_call`."""
    call = group.gen.tool_call
    if call is not None:
        return {"type": "function_call", "id": item_id("fc", group), "call_id": item_id("call", group),
                "name": call.name, "arguments": text, "status": status}  # fmt: skip
    live = group.lives[0]
    top_k = group.gen.logprobs
    logprobs: list[dict[str, Any]] | None = None
    if top_k is not None:
        logprobs = chat_logprobs(live.logprobs, top_k)["content"] if status == "completed" else []
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}] if text else []
    return {"type": "message", "id": item_id("msg", group), "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def usage(group: LiveGroup) -> dict[str, Any]:
    live = group.lives[0]
    out = min(live.produced, live.num_output_tokens)
    return {
        "input_tokens": live.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": live.cached_tokens},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": live.num_prompt_tokens + out,
    }


def response_object(
    call: ResponsesCall, group: LiveGroup, done: bool, status: str | None = None
) -> dict[str, Any]:
    """The response object: `in_progress` (or the `status` given: a background response is
    stored `queued`) until `done`, then with `output` and `usage` filled.

    A finished text answer ran to `max_output_tokens` unless a stop string ended it (the emulator
    never ends a turn by itself), and vLLM reports a length-capped generation as `incomplete` with that reason
    (`ResponsesResponse.from_request`), even in the stream's final `response.completed` event.
    """
    capped = done and group.lives[0].finish_reason == "length"
    status = "incomplete" if capped else "completed" if done else status or "in_progress"
    return {
        "id": call.response_id,
        "object": "response",
        "created_at": group.created,
        "model": group.gen.model,
        "status": status,
        "background": call.background,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if capped else None,
        **call.echo,
        "max_tool_calls": None,
        "output": [output_item(group, "completed", group.lives[0].answer.text)] if done else [],
        "reasoning": None,
        "service_tier": "auto",
        "store": call.store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage(group) if done else None,
    }


def finished_history(call: ResponsesCall, group: LiveGroup) -> tuple[dict[str, Any], ...]:
    """The conversation after this response: its history plus the answer as an assistant turn."""
    live = group.lives[0]
    call_spec = group.gen.tool_call
    if call_spec is None:
        answer: dict[str, Any] = {"role": "assistant", "content": live.answer.text}
    else:
        fn = {"name": call_spec.name, "arguments": live.answer.text}
        tool_call = {"id": item_id("call", group), "type": "function", "function": fn}
        answer = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    return (*call.history, answer)


class EventWriter:
    """Server-sent events of a streamed response: `event: <type>` + JSON with `sequence_number`."""

    def __init__(self) -> None:
        self._seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = named_event(kind, {"sequence_number": self._seq, **fields})
        self._seq += 1
        return event
