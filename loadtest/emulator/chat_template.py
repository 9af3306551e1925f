"""The emulator's chat template: messages (and tools) rendered to one prompt string.

    <|system|>\n{system content}<|end|>\n          (each message, in order)
    <|tools|>\n{tools as compact JSON}<|end|>\n     (after the first system message, or first)
    <|user|>\n{content}<|end|>\n
    <|assistant|>\n{content}<|end|>\n               (tool calls: <|tool_call|>{name} {arguments})
    <|tool|>\n{tool_call_id}\n{content}<|end|>\n
    <|assistant|>\n                                 (generation prompt, unless disabled)

Text content parts (and parts sent as plain strings) are concatenated; an image part renders as a
fixed-length placeholder named by a digest of its URL (`IMAGE_TOKENS` characters, so exactly that
many tokens with the default byte tokenizer): the same image shares cache, another image does not.
Audio (`audio_url`, `input_audio`) and video (`video_url`) parts render the same way, named by
their kind and a digest of their data. As in vLLM, a part without a `type` takes the type of the
first media field it has (`{"image_url": "https://..."}`), and any role is rendered as it is
(vLLM's custom roles). The assistant turn renders exactly
as the generation prompt followed by the generated text, so a next turn that repeats an answer
shares its cached blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.emulator.errors import ApiError

# An image costs a fixed number of tokens, as a vision encoder's patch grid does (576 = 24 x 24,
# the LLaVA-1.5 grid).
IMAGE_TOKENS = 576


def image_placeholder(url: str) -> str:
    """The text an image renders as: fixed length, named by a digest of its URL (or data URL)."""
    head = "<|image|>" + hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
    return (head + "." * IMAGE_TOKENS)[:IMAGE_TOKENS]


def media_placeholder(kind: str, data: Any) -> str:
    """The text an audio or video part renders as: fixed length, named by its kind and a digest of
    its data (its URL, or its inline data and format)."""
    digest = hashlib.blake2b(orjson.dumps(data, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
    return (f"<|{kind}|>{digest}" + "." * IMAGE_TOKENS)[:IMAGE_TOKENS]


def _url(part: Mapping[str, Any], field: str) -> str | None:
    """A media part's URL: `{field: {"url": ...}}`, or `{field: "..."}` (vLLM's simple forms)."""
    value = part.get(field)
    url = value.get("url") if isinstance(value, Mapping) else value
    return url if isinstance(url, str) and url else None


# vLLM's media part types that carry a URL, and what each renders as.
_URL_KINDS = {"image_url": "image", "input_image": "image", "audio_url": "audio", "video_url": "video"}
# The fields that type a part sent without `type`, in vLLM's order (`parse_chat_message_content_mm_part`)
# (its embeddings and PIL forms are left out: no client of the emulator sends them).
_UNTYPED = ("image_url", "audio_url", "input_audio", "video_url")


def _part_text(part: Any) -> str | None:
    """The text a content part renders as; None for a part the emulated model does not take."""
    if isinstance(part, str):  # vLLM reads a string part as a text part
        return part
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind is None:
        kind = next((field for field in _UNTYPED if field in part), None)
    if kind == "text":
        text = part.get("text")
        return text if isinstance(text, str) else None
    if kind == "input_audio":
        audio = part.get("input_audio")
        ok = isinstance(audio, Mapping) and isinstance(audio.get("data"), str)
        return media_placeholder("audio", audio) if ok else None
    if kind in _URL_KINDS:
        url = _url(part, "image_url" if kind == "input_image" else str(kind))
        if url is None:
            return None
        return (
            image_placeholder(url)
            if _URL_KINDS[kind] == "image"
            else media_placeholder(_URL_KINDS[kind], url)
        )
    return None


def message_text(content: Any, where: str) -> str:
    """The text of a message's `content`: a string, null, or a list of parts: text (or plain
    strings), images, audio and video (`_part_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            text = _part_text(part)
            if text is None:
                raise ApiError.bad_request(
                    "content parts must be text, or image_url, audio_url, input_audio or video_url parts "
                    "with their data",
                    f"{where}.content[{i}]",
                )
            parts.append(text)
        return "".join(parts)
    raise ApiError.bad_request("content must be a string or a list of content parts", f"{where}.content")


def _tool_calls_text(calls: Any, where: str) -> str:
    if not isinstance(calls, list):
        raise ApiError.bad_request("tool_calls must be a list", f"{where}.tool_calls")
    out: list[str] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ApiError.bad_request("tool call needs function.name", f"{where}.tool_calls[{j}]")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = orjson.dumps(args).decode()
        out.append(f"<|tool_call|>{fn['name']} {args}")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered prompt and, per message, the character offset where its content starts."""

    text: str
    content_starts: tuple[int, ...]


def render_chat(
    messages: Sequence[Any], tools: Sequence[Any] | None, add_generation_prompt: bool = True
) -> str:
    """Render a validated-as-we-go chat request; raises ApiError naming the bad message."""
    return render_chat_offsets(messages, tools, add_generation_prompt).text


def render_chat_offsets(
    messages: Sequence[Any], tools: Sequence[Any] | None, add_generation_prompt: bool = True
) -> RenderedChat:
    """`render_chat` plus where each message's content starts (for cache breakpoints)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError.bad_request("messages must be a non-empty list", "messages")
    tools_block = ""
    if tools:
        tools_block = (
            "<|tools|>\n" + orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode() + "<|end|>\n"
        )
    out: list[str] = []
    starts: list[int] = []
    length = 0
    tools_done = not tools_block
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ApiError.bad_request("each message must be an object", where)
        role = msg.get("role")
        if not isinstance(role, str):  # any string: vLLM takes custom roles, as the template does
            raise ApiError.bad_request("role must be a string", f"{where}.role")
        if not tools_done and role not in ("system", "developer"):
            out.append(tools_block)
            length += len(tools_block)
            tools_done = True
        text = message_text(msg.get("content"), where)
        if role == "assistant" and msg.get("tool_calls"):
            text += _tool_calls_text(msg["tool_calls"], where)
        if role == "tool":
            call_id = msg.get("tool_call_id", "")
            text = f"{call_id}\n{text}"
        head = f"<|{role}|>\n"
        starts.append(length + len(head))
        out.append(f"{head}{text}<|end|>\n")
        length += len(out[-1])
        if not tools_done:
            out.append(tools_block)
            length += len(tools_block)
            tools_done = True
    if not tools_done:
        out.append(tools_block)
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return RenderedChat("".join(out), tuple(starts))
