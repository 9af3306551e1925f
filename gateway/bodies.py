"""Request bodies at the edge: one parse, the few fields routing needs checked, one encode.

Only what routing needs is validated here (`model`, the route's prompt field, `stream`,
`stream_options`, `priority`, `n`, `best_of`); everything else is the worker's to judge and is
forwarded untouched, but for an empty `tools` list, which engines read differently
(`_without_empty_tools`). Those fields are read as the worker's lax pydantic models read them
(`prompt_normalizer.lax`), only on routes whose request model has them (`ApiRoute.fields`), and a
value not sent as the exact type (`"stream": "true"`, `"n": "2"`) is kept as read, so that every
reader in the gateway agrees with the worker.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.config import EnginePriorityConfig
from gateway.engine_fields import check_internal, check_nested_internal, sampling_entries
from gateway.errors import ApiError, bad_request
from gateway.multipart import boundary_of, content_type_header, form_fields
from gateway.pooling_inputs import check_pooling_inputs
from gateway.prompt_batch import batch_sizes, check_fanout, check_sequences, fanned_out
from gateway.routes import ApiRoute, Fanout
from prompt_normalizer.generate_input import GENERATE_PROMPT_FIELDS
from prompt_normalizer.lax import lax_bool, lax_int

# The engines' prefix-cache isolation keys: vLLM's `cache_salt`; SGLang's `extra_key` (its native
# request's, and on its OpenAI routes joined to `cache_salt`). Not refused: a client's is dropped,
# and the gateway sets its own (`routes.ApiRoute.salt_field`).
ISOLATION_FIELDS = ("cache_salt", "extra_key")

# orjson parses up to 1024 levels but encodes at most 254, and every body is encoded again on its
# way to the worker (with the gateway's `cache_salt`), as are parts of it by the normalizer.
MAX_JSON_DEPTH = 254

# The form fields of a multipart body that the gateway reads (the file is never looked at).
_FORM_FIELDS = frozenset({"model", "stream", "priority"})


def parse_body(
    raw: bytes, api: ApiRoute, max_choices: int = 128, max_pooling_inputs: int = 2048
) -> dict[str, Any]:
    """The request body as a JSON object, with the fields routing needs checked; 400 otherwise.
    On chat and completions, `n` and `best_of` are checked too (`check_choices`); on the pooling
    routes, the count of inputs (`pooling_inputs.check_pooling_inputs`)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if api.pick is not None:
        api = api.pick(body)  # the route the body names is the one to check it against
    model = body.get("model")
    # `""` names no model, as absent does (vLLM serves its own for either, `missing_model`); absent
    # is refused only where vLLM's request model requires the field (Anthropic's Messages).
    if model.__class__ is not str and (model is not None or not api.model_optional):
        raise bad_request("'model' is required and must be a string", "model")
    # Before the prompt's checks: a prompt sent as embeddings alone names the field refused, not
    # the text it lacks.
    check_internal(body)
    if api.has_tools:
        tools = body.get("tools")
        if tools.__class__ is list and not tools:
            _without_empty_tools(body)
    prompt = api.prompt
    if prompt == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' is required and must be a non-empty array", "messages")
        for message in messages:  # a loop, not all() over a generator: half the cost a request
            if not isinstance(message, dict):
                raise bad_request("every entry of 'messages' must be an object", "messages")
    elif prompt == "completions":
        prompt_field = body.get("prompt")
        if not isinstance(prompt_field, str | list) or not prompt_field:
            raise bad_request("'prompt' is required and must be a string or a non-empty array", "prompt")
    elif prompt is not None:
        _check_api_prompt(body, prompt)
    if api.has_stream:
        stream = body.get("stream")
        if stream is not None and stream.__class__ is not bool:
            body["stream"] = _lax_flag(stream, "stream")
    if api.has_stream_options:
        options = body.get("stream_options")
        if options is not None:
            if options.__class__ is not dict:
                raise bad_request("'stream_options' must be an object", "stream_options")
            for name in _STREAM_OPTION_FLAGS:
                # A value not read as the worker reads it would decide usage the other way.
                flag = options.get(name)
                if flag is not None and flag.__class__ is not bool:
                    options[name] = _lax_flag(flag, f"stream_options.{name}")
    if api.has_priority:
        priority = body.get("priority", 0)
        if priority.__class__ is not int or priority not in PRIORITY_RANGE:
            body["priority"] = _read_priority(priority)
    else:
        # Neither checked nor read: the worker ignores it there, and the gateway never sends a
        # client's own (`engine_priority`), so it counts as 0 in the queue.
        body.pop("priority", None)
    if api.rewrites:
        check_choices(body, max_choices)
    elif prompt == "generate":
        # A batch may give each prompt its own sampling parameters: each entry is checked.
        for path, entry in sampling_entries(body):
            check_choices(entry, max_choices, path + ".")
    if prompt in ("completions", "generate"):
        check_sequences(body, prompt, _choices(body, prompt), max_choices)
    elif api.fanout is not None:  # a read prefills each item or question for one token
        choices = _choices(body, None) if api.fanout == "conversations" else 1
        check_fanout(body, api.fanout, choices, max_choices)
    elif api.pooled is not None:  # each input is encoded on its own
        check_pooling_inputs(body, api.pooled, max_pooling_inputs)
    if "vllm_xargs" in body or "sampling_params" in body:
        check_nested_internal(body)
    return body


_STREAM_OPTION_FLAGS = ("include_usage", "continuous_usage_stats")


# The `tool_choice` values that call no tool: OpenAI's strings (chat and Responses) and Anthropic's
# objects (`{"type": "auto"}`, which may carry `disable_parallel_tool_use`).
_NO_CALL_CHOICES = ("none", "auto")


def _without_empty_tools(body: dict[str, Any]) -> None:
    """A body whose `tools` is `[]` made the body without the field: the request as every engine
    serves it, whichever worker gets it.

    An empty list asks for no tool, but engines read it differently: vLLM refuses it on chat with
    400 since it followed OpenAI's chat API there, older vLLM and SGLang serve it as no tools,
    vLLM's Responses has it as its default, and vLLM's Messages makes it a `tool_choice` "auto"
    among no tools (400 unless the worker was started with auto tool choice). Clients (SDK
    wrappers, agent frameworks) send it for "no tools", and a fleet in the middle of an upgrade
    would answer them 200 or 400 by the worker picked. A `tool_choice` of "auto" goes with it
    (auto among no tools calls none; vLLM refuses "auto" without tools), "none" stays (taken with
    or without tools); one that asks for a call (`required`, Anthropic's `any`, a named tool)
    cannot be served, and is refused here, naming the field."""
    del body["tools"]
    choice = body.get("tool_choice")
    kind = choice.get("type") if choice.__class__ is dict else choice
    if choice is not None and kind not in _NO_CALL_CHOICES:
        raise bad_request(
            "'tool_choice' must be 'none' or 'auto' when 'tools' is empty: no tool can be called",
            "tool_choice",
        )
    if kind == "auto":
        del body["tool_choice"]


def _lax_flag(value: object, field: str) -> bool:
    """A boolean field the worker reads in lax mode (`"true"`, 1, `"yes"`...: `lax.lax_bool`),
    as a `bool`; 400 for what the worker refuses."""
    flag = lax_bool(value)
    if flag is None:
        raise bad_request(f"'{field}' must be a boolean", field)
    return flag


# The engines' priorities are 64-bit signed integers (vLLM's requests cross to its engine as
# msgpack); a larger one cannot be encoded again on its way to the worker.
PRIORITY_RANGE = range(-(2**63), 2**63)


def _read_priority(value: object) -> int:
    """`priority` that is not a 64-bit `int` as sent, made one as the worker reads it in lax mode
    (`"2"`, 2.0, `true`); 400 naming the field for what lax mode refuses or for an integer beyond
    64 bits (`"99999999999999999999"`, or 1e20 sent as a number)."""
    read = lax_int(value)
    if read is None:
        raise bad_request("'priority' must be an integer (lower is served earlier)", "priority")
    if read not in PRIORITY_RANGE:
        raise bad_request("'priority' must be an integer from -2**63 to 2**63 - 1", "priority")
    return read


def asks_usage(options: object) -> bool:
    """Whether a chat or completions body's `stream_options` (read by `parse_body`) asks for
    usage in its stream: `include_usage` true, as OpenAI, SGLang and vLLM read it (vLLM's
    `StreamOptions` defaults both its flags to false, and `continuous_usage_stats` acts only
    together with `include_usage`: `should_include_usage`). So `{}` and
    `{"continuous_usage_stats": true}` alone ask for none, and the gateway asks for its own
    (`forced_usage`)."""
    return isinstance(options, dict) and options.get("include_usage") is True


def forced_usage(options: object) -> dict[str, Any]:
    """The `stream_options` the gateway sends for a stream that did not ask for usage
    (`asks_usage`): the client's, asking for the final usage chunk only (which the relay drops,
    `sse.SseRelay`). vLLM puts usage on every chunk when `continuous_usage_stats` is true as
    well, so that flag is left out: without `include_usage` it has no effect in vLLM."""
    out = {**options} if isinstance(options, dict) else {}
    out.pop("continuous_usage_stats", None)
    out["include_usage"] = True
    return out


def streams(body: dict[str, Any], api: ApiRoute) -> bool:
    """Whether the request asks for a stream (its `stream`, read by `parse_body` or
    `parse_form`, on a route that has the field)."""
    return api.has_stream and body.get("stream") is True


# The fields that multiply one request's work on the worker: every choice decodes (and with
# `best_of`, is generated and scored) on its own.
_CHOICE_FIELDS = ("n", "best_of")


def check_choices(body: dict[str, Any], max_choices: int, path: str = "") -> None:
    """`n` and `best_of`, when set, are integers from 1 to `max_choices`: one request asking for
    many thousand choices would fill a worker's queue by itself (and fail there), where a
    tenant's limits count it as one request. `path` prefixes the field names in errors (the
    native generate routes' `sampling_params.`)."""
    for name in _CHOICE_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        field = path + name
        if value.__class__ is not int:
            # Read as the worker reads it (`"2"`, 2.0: `lax.lax_int`), and kept so: every reader
            # of the body (the choices counted, the P/D split) then sees what the worker runs.
            value = lax_int(value)
            if value is not None:
                body[name] = value
        if value is None or value < 1:
            raise bad_request(f"'{field}' must be an integer of at least 1", field)
        if value > max_choices:
            # OpenAI's code for the same refusal, so that clients handling it there handle it here.
            message = f"'{field}' is {value}: this gateway serves at most {max_choices} choices per request"
            raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", field)


def _check_api_prompt(body: dict[str, Any], prompt: str) -> None:
    """The top-level shape of a Responses, Messages or native generate prompt (the normalizer
    checks the rest)."""
    if prompt == "generate":
        if not any(isinstance(body.get(name), str | list) and body[name] for name in GENERATE_PROMPT_FIELDS):
            raise bad_request(
                "'text' or 'input_ids' is required: a string, token ids or a non-empty array", "text"
            )
    elif prompt == "responses":
        value = body.get("input")
        if not isinstance(value, str | list):
            raise bad_request("'input' is required and must be a string or an array of items", "input")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' is required and must be a non-empty array", "messages")


def parse_form(raw: bytes, content_type: str | None, api: ApiRoute) -> dict[str, Any]:
    """The fields routing reads from a multipart body (`model`, `stream`); 400 when the body is
    not a well-formed multipart form."""
    fields = form_fields(raw, content_type, _FORM_FIELDS)
    model = fields.get("model")
    if model is None and not api.model_optional:  # `""` names no model, as in `parse_body`
        raise bad_request("'model' is required", "model")
    if "priority" in fields:
        # A form is forwarded as sent, so the gateway could not replace it (`engine_priority`).
        raise bad_request("'priority' cannot be set on a form body through this gateway", "priority")
    body: dict[str, Any] = {"model": model} if model else {}
    stream = fields.get("stream")
    if stream is not None:
        # As vLLM's form model reads it (lax mode: `true`, `1`, `yes`, `on`, `t`, `y`, any case).
        body["stream"] = _lax_flag(stream, "stream")
    return body


def form_head(content_type: str | None) -> bytes:
    """The start of the headers that carry a multipart body to a worker (the request id follows)."""
    return content_type_header(boundary_of(content_type)) + b"X-Request-Id: "


def encode_body(body: dict[str, Any]) -> bytes:
    """The body re-encoded without the client's cache isolation keys (`ISOLATION_FIELDS`): the
    gateway sets its own on the routes that take one, and no client chooses its namespace in an
    engine's cache.

    This is also the nesting bound: encoding refuses JSON nested deeper than `MAX_JSON_DEPTH`, at
    the cost of one `orjson.dumps`, which `Admitted.body_for` then reuses instead of encoding again
    (faster than counting brackets in the raw bytes or walking the parsed objects in Python).
    """
    for name in ISOLATION_FIELDS:
        body.pop(name, None)
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        if "64-bit" in str(exc):  # an integer the gateway read from a string (orjson's message)
            raise bad_request("request body holds an integer beyond 64 bits") from None
        raise bad_request(
            f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of JSON objects and arrays"
        ) from None


# Where each generating route's engine reads the output budget, the first field set winning (vLLM
# and SGLang chat take `max_completion_tokens`, else `max_tokens`). Only those: a field the
# engine ignores must not be the one counted, or `max_completion_tokens: 1, max_tokens: 4000` on
# completions would count 1 token while the worker generates 4,000.
_OUTPUT_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}

# The most output tokens one request counts for in its worker's load while its model's context
# window is not known (neither stated, `PoolConfig.max_model_len`, nor reported by the workers,
# `model_window.py`): 128k tokens, the window of most models served today. No answer is longer
# than the window, and a client's budget counted whole (any integer passes JSON) would make its
# worker look busy for years to the policy.
ASSUMED_MAX_MODEL_LEN = 131_072


# The native generate routes' budgets, in `sampling_params`: vLLM's `/inference/v1/generate`
# (`max_tokens`) and SGLang's `/generate` (`max_new_tokens`). One route kind serves both engines,
# so the larger of the two counts.
_SAMPLING_OUTPUT_FIELDS = ("max_tokens", "max_new_tokens")


def _positive_int(value: object) -> int | None:
    """A positive integer field as the worker reads it (lax: `"4000"` and `4000.0` are 4000), else
    None (absent, refused by lax mode, or not positive: the worker's own 400 then)."""
    if value.__class__ is not int:
        if value is None:
            return None
        value = lax_int(value)
        if value is None:
            return None
    return value if value > 0 else None


def _output_field(body: dict[str, Any], prompt: str | None) -> tuple[str, int] | None:
    """The field naming the request's output budget on its route (`ApiRoute.prompt`; its path)
    and the budget, if any."""
    if prompt == "generate":
        # One for every prompt, or one per prompt of a batch: the largest budget counts.
        found = [
            (f"{path}.{n}", v)
            for path, entry in sampling_entries(body)
            for n in _SAMPLING_OUTPUT_FIELDS
            if (v := _positive_int(entry.get(n)))
        ]
        return max(found, key=lambda item: item[1]) if found else None
    for name in _OUTPUT_FIELDS.get(prompt or "", ()):
        if (value := _positive_int(body.get(name))) is not None:
            return name, value
    return None


def _choices(body: dict[str, Any], prompt: str | None) -> int:
    """The sequences one request decodes: the largest of `n` and `best_of` (already checked to be
    within `limits.max_choices`), 1 when neither is set."""
    if prompt != "generate":  # one object: the expression below for it alone, without a generator
        n = _positive_int(body.get("n")) or 1
        best_of = _positive_int(body.get("best_of")) or 1
        return n if n >= best_of else best_of
    # One object for every prompt, or one per prompt of a batch.
    values = (_positive_int(e.get(name)) or 1 for _, e in sampling_entries(body) for name in _CHOICE_FIELDS)
    return max(values, default=1)


def output_budget(
    body: dict[str, Any], prompt: str | None, max_model_len: int | None, fanout: Fanout | None = None
) -> int:
    """The request's output budget as it counts in its worker's load, for a route whose
    `ApiRoute.prompt` is `prompt` (chat and completions, Messages `max_tokens`, Responses
    `max_output_tokens`, the native generate routes' `sampling_params`; the field its engine
    reads, `_OUTPUT_FIELDS`) or whose `ApiRoute.fanout` is `fanout` (a batch of chat completions:
    chat's fields): at most its model's context window `max_model_len`, stated or learned
    (`model_window.PoolWindows`; `ASSUMED_MAX_MODEL_LEN` when None), times the choices it asks
    for (`n`, `best_of`: each decodes its own) and the prompts of a batch (each decodes its own
    budget); 0 when it sets none. A budget past a known window is refused with 400, as vLLM
    refuses it (`max_tokens` greater than `max_model_len`); one up to the window is served, vLLM
    shortening it to what the prompt leaves (`get_max_tokens`), so it counts as at most the window
    less one token (every prompt has one)."""
    found = _output_field(body, "chat" if fanout == "conversations" else prompt)
    if found is None:
        return 0
    name, value = found
    if max_model_len is None:
        value = min(value, ASSUMED_MAX_MODEL_LEN)
    elif value > max_model_len:
        message = (
            f"'{name}' is too large: {value}. This model's maximum context length is {max_model_len} "
            "tokens, for the prompt and the output together"
        )
        raise ApiError(400, message, "invalid_request_error", "integer_above_max_value", name)
    elif value == max_model_len:
        value = max(max_model_len - 1, 1)
    if fanout is not None:
        return value * _choices(body, None) * (fanned_out(body, fanout) or 1)
    sizes = batch_sizes(body, prompt)
    return value * _choices(body, prompt) * (1 if sizes is None else len(sizes))


def engine_priority(client_priority: int, band: EnginePriorityConfig, scheduling: str) -> int | None:
    """The `priority` a request sends to workers that schedule as `scheduling`
    (`PoolConfig.priority_scheduling`): none when they do not schedule by it (vLLM refuses any but
    0 then, and SGLang may), else its tenant's `band` value for the client's own `priority`, in
    the engine's direction (lower first in the config, as in vLLM)."""
    if scheduling == "off":
        return None
    value = band.value(client_priority)
    return -value if scheduling == "higher_first" else value


def with_priority(body: dict[str, Any], encoded: bytes, priority: int | None) -> tuple[dict[str, Any], bytes]:
    """`body` (`encoded` is its encoding) carrying `priority` as its `priority` field (None: no
    such field), and its encoding; the same objects when that changes nothing. A body without the
    field gets it in front of its encoding, so a large body is not encoded a second time."""
    had = "priority" in body
    if not had and priority is None:
        return body, encoded
    if had and body["priority"] == priority and type(body["priority"]) is int:
        return body, encoded
    if priority is None:
        out = {name: value for name, value in body.items() if name != "priority"}
        return out, orjson.dumps(out)
    out = {**body, "priority": priority}
    if had:
        return out, orjson.dumps(out)
    head = b'{"priority":' + str(priority).encode()
    return out, head + (b"," + encoded[1:] if encoded != b"{}" else b"}")


# The most served model ids `missing_model` names (a gateway may serve hundreds of LoRA adapters;
# `GET /v1/models` lists them all).
MODELS_NAMED = 8


def missing_model(served: list[str]) -> ApiError:
    """A request that names no model (no `model`, or `""`): vLLM serves its own model then (it
    takes any empty name, `OpenAIServing._is_model_supported`), so the gateway does when it serves
    one model (`keying.only_model`); with several, which one is meant is the client's to say, and
    the error names them (the first `MODELS_NAMED`, in config order)."""
    named = ", ".join(f"'{model}'" for model in served[:MODELS_NAMED])
    more = len(served) - MODELS_NAMED
    if more > 0:
        named += f" and {more} more (GET /v1/models lists them)"
    return bad_request(f"'model' is required: this gateway serves {len(served)} models: {named}", "model")
