"""Parse and validate OpenAI request bodies into what the worker runs.

Unknown fields are ignored (as vLLM does with a warning); sampling parameters are accepted and
have no effect, since output text is deterministic. Bad values raise ApiError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from loadtest.emulator.chat_template import render_chat
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.tools import choose_tool, tool_call_arguments
from loadtest.engine.tokenizer import Tokenizer, TokenizerError

Endpoint = Literal["chat", "completions"]
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request: the prompt's token ids and how to answer."""

    endpoint: Endpoint
    model: str
    prompt_ids: np.ndarray
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    tool_call: ToolCall | None
    echo_sampling: dict[str, Any]


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError.bad_request(f"{name} must be an integer >= {minimum}", name)
    return value


def _common(body: Mapping[str, Any], cfg: EmulatorConfig) -> tuple[str, int, bool, bool, str | None]:
    model = body.get("model")
    if model is None:
        model = cfg.model
    if not isinstance(model, str):
        raise ApiError.bad_request("model must be a string", "model")
    if model != cfg.model:
        raise ApiError.not_found(f"The model `{model}` does not exist.", "model")
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    n = _int_field(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError.bad_request("the emulated worker supports n=1 only", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError.bad_request("stream must be a boolean", "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError.bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(options, Mapping):
            raise ApiError.bad_request("stream_options must be an object", "stream_options")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise ApiError.bad_request("include_usage must be a boolean", "stream_options.include_usage")
        include_usage = flag
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ApiError.bad_request(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    return model, max_tokens, stream, include_usage, salt


def _sampling(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    keep = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty")
    out = {k: body[k] for k in keep if k in body}
    out["max_tokens"] = max_tokens
    return out


def render_chat_body(body: Mapping[str, Any]) -> str:
    """The prompt text of a chat body (also used by the render endpoint)."""
    messages = body.get("messages")
    tools = body.get("tools")  # rendered even with tool_choice "none", as vLLM does by default
    if tools is not None and not isinstance(tools, list):
        raise ApiError.bad_request("tools must be a list", "tools")
    flag = body.get("add_generation_prompt", True)
    if not isinstance(flag, bool):
        raise ApiError.bad_request("add_generation_prompt must be a boolean", "add_generation_prompt")
    return render_chat(messages if isinstance(messages, list) else [], tools, flag)


def parse_chat(body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer) -> GenerationRequest:
    model, max_tokens, stream, include_usage, salt = _common(body, cfg)
    text = render_chat_body(body)
    tool = choose_tool(body.get("tools"), body.get("tool_choice"), list(body.get("messages") or []))
    call = ToolCall(*tool_call_arguments(tool)) if tool is not None else None
    return GenerationRequest(
        endpoint="chat",
        model=model,
        prompt_ids=tokenizer.encode(text),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        tool_call=call,
        echo_sampling=_sampling(body, max_tokens),
    )


def completion_prompt_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> np.ndarray:
    """Token ids of a completions `prompt`: a string, or token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError.bad_request("prompt must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
            raise ApiError.bad_request(f"token ids must be in 0..{tokenizer.vocab_size - 1}", "prompt")
        return ids
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError.bad_request("the emulated worker accepts one prompt per request", "prompt")
    raise ApiError.bad_request("prompt must be a non-empty string or a list of token ids", "prompt")


def parse_completions(
    body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer
) -> GenerationRequest:
    model, max_tokens, stream, include_usage, salt = _common(body, cfg)
    try:
        ids = completion_prompt_ids(body, tokenizer)
    except TokenizerError as exc:
        raise ApiError.bad_request(str(exc), "prompt") from exc
    return GenerationRequest(
        endpoint="completions",
        model=model,
        prompt_ids=ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        tool_call=None,
        echo_sampling=_sampling(body, max_tokens),
    )
