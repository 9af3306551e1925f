"""Parse and validate OpenAI request bodies into what the worker runs.

Unknown fields are ignored (as vLLM does with a warning); sampling parameters are accepted and
have no effect, since output text is deterministic, except stop strings, which end that text
where they occur in it (`stops.py`). Bad values raise ApiError naming the field.
The field helpers here are shared by every route family (Responses and Anthropic Messages too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
from pydantic import TypeAdapter, ValidationError

from loadtest.emulator.chat_template import render_chat
from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.prompts import completion_prompts
from loadtest.emulator.stops import StopRule
from loadtest.emulator.tools import choose_tool, tool_call_arguments
from loadtest.engine.tokenizer import Tokenizer
from prompt_normalizer.lax import lax_bool, lax_int

_FLOAT: Final = TypeAdapter(float)

Endpoint = Literal["chat", "completions", "responses", "messages"]
MAX_CACHE_SALT_CHARS = 1024
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The call an answer makes: its generated text is `arguments`. `named`: the request named
    the tool (`tool_choice` an object), so vLLM takes whatever text was generated as the
    arguments, even one a stop string cut; otherwise its tool parser must find a whole call."""

    name: str
    arguments: str
    named: bool = False


def tool_call_for(tools: Any, tool_choice: Any, messages: list[Any]) -> ToolCall | None:
    """The call a request's answer makes (`tools.choose_tool`), with a chat-shaped `tool_choice`."""
    tool = choose_tool(tools, tool_choice, messages)
    if tool is None:
        return None
    return ToolCall(*tool_call_arguments(tool), named=isinstance(tool_choice, Mapping))


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request: the prompts' token ids and how to answer.

    Every prompt gets `n` sequences (choices); `logprobs` is the number of alternatives reported
    per output token (0: the chosen token only), None when logprobs were not asked for; `stop`
    ends the generated text (a tool call's too) at a stop string (`stops.py`).
    """

    endpoint: Endpoint
    model: str
    prompts: tuple[np.ndarray, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    tool_call: ToolCall | None
    echo_sampling: dict[str, Any]
    n: int = 1
    logprobs: int | None = None
    request_id: str | None = None
    priority: int = 0
    continuous_usage: bool = False  # usage on every chunk too (`continuous_usage_stats`)
    stop: StopRule | None = None
    budget_field: str = "max_tokens"  # the field `max_tokens` was read from (named in errors)

    @property
    def prompt_ids(self) -> np.ndarray:
        """The first (usually only) prompt."""
        return self.prompts[0]

    def rendered(self, request_id: str) -> dict[str, Any]:
        """What vLLM's render routes answer for this request: its prompt's token ids and sampling
        parameters, ready for a `/generate` call."""
        return {
            "request_id": request_id,
            "token_ids": self.prompt_ids.tolist(),
            "sampling_params": self.echo_sampling,
            "model": self.model,
            "features": None,
        }


@dataclass(frozen=True, slots=True)
class CommonFields:
    """The fields every generation route reads the same way."""

    model: str
    stream: bool
    cache_salt: str | None
    request_id: str | None
    priority: int


def int_field(body: Mapping[str, Any], name: str, minimum: int, maximum: int | None = None) -> int | None:
    """An optional integer field within bounds, read as vLLM's lax pydantic models read one
    (`2`, `2.0`, `"2"`, `true`; not `2.5` or `"two"`)."""
    value = body.get(name)
    if value is None:
        return None
    value = lax_int(value)
    if value is None or value < minimum:
        raise ApiError.bad_request(f"{name} must be an integer >= {minimum}", name)
    if maximum is not None and value > maximum:
        raise ApiError.bad_request(f"{name} must be at most {maximum}", name)
    return value


def bool_field(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    flag = lax_bool(value)  # as vLLM reads it: `"true"`, 1, `"yes"`, `"on"`...
    if flag is None:
        raise ApiError.bad_request(f"{name} must be a boolean", name)
    return flag


def check_model(body: Mapping[str, Any], cfg: EmulatorConfig) -> str:
    """The served model name; a missing or empty model means the served one (vLLM's
    `_is_model_supported`), another name is a 404."""
    model = body.get("model")
    if model is None:
        return cfg.model
    if not isinstance(model, str):
        raise ApiError.bad_request("model must be a string", "model")
    if not model:
        return cfg.model
    if model != cfg.model:
        raise ApiError.not_found(f"The model `{model}` does not exist.", "model")
    return model


def common_fields(body: Mapping[str, Any], cfg: EmulatorConfig) -> CommonFields:
    """model, stream, vLLM's `cache_salt`, `request_id` and `priority`.

    `priority` is accepted and has no effect: the engine model schedules first come, first served.
    """
    model = check_model(body, cfg)
    stream = bool_field(body, "stream")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ApiError.bad_request(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise ApiError.bad_request("request_id must be a non-empty string", "request_id")
    priority = lax_int(body.get("priority", 0))  # vLLM's `priority: int = 0`: null is refused
    if priority is None:
        raise ApiError.bad_request("priority must be an integer", "priority")
    return CommonFields(model, stream, salt, request_id, priority)


# The sampling fields of vLLM's generating request models, each `float | None` or `int | None`:
# the emulator has no use for their values, but a value pydantic's lax mode refuses there
# (`"temperature": "hot"`) is a 400 here too. `seed` is a 64-bit integer.
SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
SAMPLING_INTS = ("top_k", "seed")
_INT64 = range(-(2**63), 2**63)


def check_sampling(
    body: Mapping[str, Any], floats: tuple[str, ...] = SAMPLING_FLOATS, ints: tuple[str, ...] = SAMPLING_INTS
) -> None:
    """400 naming the first of `floats` and `ints` that is set (not null) to a value vLLM's lax
    pydantic model refuses (`"hot"`, `[1]`; `"0.5"` and `1` are numbers there)."""
    for name in floats:
        value = body.get(name)
        if value is None or value.__class__ is float or value.__class__ is int:
            continue
        try:
            _FLOAT.validate_python(value)
        except ValidationError:
            raise ApiError.bad_request(f"{name}: Input should be a valid number", name) from None
    for name in ints:
        value = body.get(name)
        if value is None:
            continue
        read = lax_int(value)
        if read is None:
            raise ApiError.bad_request(f"{name}: Input should be a valid integer", name)
        if name == "seed" and read not in _INT64:
            raise ApiError.bad_request("seed: Input should be a 64-bit integer", name)


def one_answer_request(
    endpoint: Endpoint,
    common: CommonFields,
    prompt: np.ndarray,
    max_tokens: int,
    tool: ToolCall | None,
    stop: StopRule | None = None,
    logprobs: int | None = None,
) -> GenerationRequest:
    """A request for one answer to one prompt, with usage always reported: the shape of the
    Responses and Anthropic Messages APIs, which have no `n` or sampling echo."""
    return GenerationRequest(
        endpoint=endpoint,
        model=common.model,
        prompts=(prompt,),
        max_tokens=max_tokens,
        stream=common.stream,
        include_usage=True,
        cache_salt=common.cache_salt,
        tool_call=tool,
        echo_sampling={"max_tokens": max_tokens},
        request_id=common.request_id,
        priority=common.priority,
        stop=stop,
        logprobs=logprobs,
        budget_field="max_output_tokens" if endpoint == "responses" else "max_tokens",
    )


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """What usage a stream reports: at its end (`include_usage`), and on every chunk too
    (`continuous`)."""

    include_usage: bool = False
    continuous: bool = False


def _stream_usage(body: Mapping[str, Any], stream: bool) -> StreamUsage:
    """vLLM's reading of `stream_options`: its `StreamOptions` defaults `include_usage` to false
    (as null), and `continuous_usage_stats` counts only with `include_usage`
    (`should_include_usage`)."""
    options = body.get("stream_options")
    if options is None:
        return StreamUsage()
    if not stream:
        raise ApiError.bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(options, Mapping):
        raise ApiError.bad_request("stream_options must be an object", "stream_options")
    include = _option_flag(options, "include_usage", False)
    return StreamUsage(include, include and _option_flag(options, "continuous_usage_stats", False))


def _option_flag(options: Mapping[str, Any], name: str, default: bool) -> bool:
    value = options.get(name, default)
    if value is None:
        return False
    flag = lax_bool(value)
    if flag is None:
        raise ApiError.bad_request(f"{name} must be a boolean", f"stream_options.{name}")
    return flag


def _max_tokens(body: Mapping[str, Any], cfg: EmulatorConfig) -> int:
    value = int_field(body, "max_completion_tokens", 1)
    if value is None:
        value = int_field(body, "max_tokens", 1)
    return cfg.default_max_tokens if value is None else value


def _check_min_tokens(body: Mapping[str, Any], max_tokens: int) -> int:
    """vLLM's checks of `min_tokens` (`SamplingParams._verify_args`): an integer from 0 to the
    request's `max_tokens` (0 when absent)."""
    if "min_tokens" not in body:
        return 0
    value = lax_int(body["min_tokens"])
    if value is None:
        raise ApiError.bad_request("min_tokens must be an integer", "min_tokens")
    if value < 0:
        raise ApiError.bad_request(
            f"min_tokens must be greater than or equal to 0, got {value}.", "min_tokens"
        )
    if value > max_tokens:
        raise ApiError.bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {value}.", "min_tokens"
        )
    return value


def stop_strings(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """A stop field (`stop`, Anthropic's `stop_sequences`): null, a string or a list of strings,
    none of them empty (`SamplingParams._verify_args`)."""
    value = body.get(name)
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ApiError.bad_request(f"{name} must be a string or a list of strings", name)
    if not all(strings):
        raise ApiError.bad_request("stop cannot contain an empty string.", name)
    return tuple(strings)


def stop_rule(body: Mapping[str, Any], min_tokens: int) -> StopRule | None:
    """The request's `stop` strings, `include_stop_str_in_output` and `min_tokens` (None: no stop)."""
    strings = stop_strings(body, "stop")
    include = bool_field(body, "include_stop_str_in_output")
    return StopRule(strings, include, min_tokens) if strings else None


def logprobs_limit(value: int, name: str) -> int:
    """`value` logprobs per token, refused above vLLM's `--max-logprobs` as vLLM refuses it."""
    if value > MAX_LOGPROBS:
        raise ApiError.bad_request(
            f"Requested sample logprobs of {value}, which is greater than max allowed: {MAX_LOGPROBS}", name
        )
    return value


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", 0)
    if top is not None and top > 0 and not wanted:
        raise ApiError.bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    return logprobs_limit(top or 0, "top_logprobs") if wanted else None


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
    flag = bool_field(body, "add_generation_prompt", True)
    return render_chat(messages if isinstance(messages, list) else [], tools, flag)


def parse_chat(body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer) -> GenerationRequest:
    common = common_fields(body, cfg)
    check_sampling(body)
    usage = _stream_usage(body, common.stream)
    max_tokens = _max_tokens(body, cfg)
    min_tokens = _check_min_tokens(body, max_tokens)
    text = render_chat_body(body)
    tool = tool_call_for(body.get("tools"), body.get("tool_choice"), list(body.get("messages") or []))
    return GenerationRequest(
        endpoint="chat",
        budget_field="max_completion_tokens"
        if body.get("max_completion_tokens") is not None
        else "max_tokens",
        model=common.model,
        prompts=(tokenizer.encode(text),),
        max_tokens=max_tokens,
        stream=common.stream,
        include_usage=usage.include_usage,
        continuous_usage=usage.continuous,
        cache_salt=common.cache_salt,
        tool_call=tool,
        echo_sampling=_sampling(body, max_tokens),
        n=int_field(body, "n", 1) or 1,
        logprobs=_chat_logprobs(body),
        request_id=common.request_id,
        priority=common.priority,
        stop=stop_rule(body, min_tokens),
    )


def parse_completions(
    body: Mapping[str, Any], cfg: EmulatorConfig, tokenizer: Tokenizer
) -> GenerationRequest:
    common = common_fields(body, cfg)
    check_sampling(body)
    usage = _stream_usage(body, common.stream)
    max_tokens = _max_tokens(body, cfg)
    min_tokens = _check_min_tokens(body, max_tokens)
    logprobs = int_field(body, "logprobs", 0)
    return GenerationRequest(
        endpoint="completions",
        model=common.model,
        prompts=completion_prompts(body, tokenizer),
        max_tokens=max_tokens,
        stream=common.stream,
        include_usage=usage.include_usage,
        continuous_usage=usage.continuous,
        cache_salt=common.cache_salt,
        tool_call=None,
        echo_sampling=_sampling(body, max_tokens),
        n=int_field(body, "n", 1) or 1,
        logprobs=None if logprobs is None else logprobs_limit(logprobs, "logprobs"),
        request_id=common.request_id,
        priority=common.priority,
        stop=stop_rule(body, min_tokens),
    )
