"""The POST routes the gateway proxies: for each path, how its request is read, keyed and answered.

`ROUTES` maps a path to an `ApiRoute`; the app dispatches a POST with one dict lookup, the same
cost for every route. A route is either cache-aware (`prompt` names the normalizer's input
adapter: the request has a prompt to key) or a load-aware pass-through (`prompt` is None: the
policy sees no keys, only the request's size). Every route gets the same auth, quotas, limits,
metrics and error handling; what differs is the API's dialect (its error shape and how its
streams are relayed), whether the body is JSON or a multipart form, and whether the gateway's
`cache_salt` goes with it (vLLM's generation requests have the field; its pooling, tokenizer and
audio requests do not).

Each route is sent to the same path on the worker (vLLM serves `/rerank` and `/v1/rerank`, ...),
except SageMaker's `/invocations`, whose body picks the route (`invocation_route`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway import anthropic
from gateway.errors import ApiError, RawResponse, error_response, normalize_worker_error
from gateway.sse import Relay, SseRelay
from gateway.sse_named import MessagesRelay, ResponsesRelay

Prompt = Literal["chat", "completions", "responses", "messages", "generate"]

# How a load-aware route's body fans out into the prompts its worker runs one by one
# (`gateway.prompt_batch`): the conversations of a batch of chat completions, the items of a
# generative scoring request, the questions about a state (`/v1/systemone`) or an input
# (`/v1/decisions`).
Fanout = Literal["conversations", "items", "state_questions", "input_questions"]

# Where a pooling route's body lists the inputs its worker encodes one by one
# (`gateway.pooling_inputs`): vLLM's `input` (embeddings, pooling, classify), Cohere's lists
# (`/v2/embed`), SGLang's `text` or `input_ids` (`/encode`), a rerank's documents, a score's
# pairs, or any of those (SageMaker's `/invocations` with a pooling body).
Pooled = Literal["input", "embed_v2", "encode", "rerank", "score", "invocations"]


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one API shapes what the gateway sends back: errors, worker errors, stream relays."""

    name: Literal["openai", "responses", "anthropic"]
    error_response: Callable[[ApiError, str], RawResponse]
    worker_error: Callable[[int, bytes], bytes]
    relay: Callable[[bool], Relay]


OPENAI = Dialect("openai", error_response, normalize_worker_error, SseRelay)
RESPONSES = Dialect("responses", error_response, normalize_worker_error, lambda _: ResponsesRelay())
ANTHROPIC = Dialect(
    "anthropic", anthropic.error_response, anthropic.normalize_worker_error, lambda _: MessagesRelay()
)


@dataclass(frozen=True, slots=True)
class ApiRoute:
    """One proxied POST route.

    `endpoint` labels metrics, access logs and spans. `prompt` names the normalizer's input
    adapter (None: load-aware pass-through). `model_optional`: vLLM takes its served model when
    the body names none, so the gateway does too when it serves one model. `multipart`: a form
    body (audio), read only for `model` and `stream`. `json_answer`: a 200 that says it is JSON
    must be a JSON object (anything else is a malformed answer), and a 200 of another content
    type is malformed too, except `application/octet-stream` on `binary_answer` routes (vLLM's
    binary embeddings, `encoding_format` "bytes"); audio answers (`json_answer` False) may be plain text.
    `answer_may_be_array`: a JSON array is a well-formed answer too (one item per prompt of a
    batch), with no usage the gateway reads. `pd_split`: the route generates, so a prefill/decode
    pool may send it as a prefill leg and a decode leg (docs/pd.md); every other route runs whole
    on one worker that serves it alone, with no KV transfer fields. `api_key_header`: the key may
    come in `x-api-key` (Anthropic clients). `rewrites`: the gateway may rewrite the body (the
    normalizer's canonical body, `stream_options.include_usage`): chat and completions only; a
    Responses or Messages body is forwarded as sent (but for an empty `tools` list, which no route
    forwards: `bodies.parse_body`). `pick`: the body chooses the route that
    serves it (SageMaker's `/invocations`); the request is then admitted, keyed, sent and counted
    as the route picked. `salted`: the gateway sets the engine's cache isolation key, in
    `salt_field` (vLLM's `cache_salt`; SGLang's native request names it `extra_key`), replacing
    any value the client sent. `fields`: which of the fields the gateway reads (`stream`,
    `stream_options`, `priority`, `tools`) the route's vLLM request model has: only those are
    checked and read (`bodies.parse_body`); a model without the field ignores it (vLLM allows
    extra fields), so the gateway does too. `engine_priority`: on a salted route, the gateway
    adds the tenant's engine priority (off where the route's vLLM model has no `priority` and
    refuses fields it lacks: `/v1/decisions`). `scale_out`: a route vLLM 0.33 serves only when
    started with `--enable-scale-out` (render, derender): without it the worker answers 403, its
    own answer to the request (passed on as any 4xx is), not a refusal of the gateway's
    credentials.
    `fanout`: the body is many prompts the worker runs one by one (`Fanout`): they count as
    sequences against `limits.max_choices`, in the prompt tokens and in the output budget
    (`prompt_batch`). `pooled`: the body lists inputs the worker encodes one by one (`Pooled`):
    they count against `limits.max_pooling_inputs`, and what each pair repeats in the prompt
    tokens (`pooling_inputs`).
    """

    endpoint: str
    path: str
    prompt: Prompt | None = None
    dialect: Dialect = OPENAI
    salted: bool = False
    salt_field: str = "cache_salt"
    model_optional: bool = True
    multipart: bool = False
    json_answer: bool = True
    binary_answer: bool = False
    answer_may_be_array: bool = False
    pd_split: bool = False
    api_key_header: bool = False
    pick: Callable[[Mapping[str, Any]], ApiRoute] | None = None
    fields: frozenset[str] = frozenset({"priority"})
    engine_priority: bool = True
    scale_out: bool = False
    fanout: Fanout | None = None
    pooled: Pooled | None = None
    path_bytes: bytes = field(init=False)
    rewrites: bool = field(init=False)
    plain_head: bool = field(init=False)
    has_stream: bool = field(init=False)
    has_stream_options: bool = field(init=False)
    has_priority: bool = field(init=False)
    has_tools: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path_bytes", self.path.encode())
        object.__setattr__(self, "has_stream", "stream" in self.fields)
        object.__setattr__(self, "has_stream_options", "stream_options" in self.fields)
        object.__setattr__(self, "has_priority", "priority" in self.fields)
        object.__setattr__(self, "has_tools", "tools" in self.fields)
        object.__setattr__(self, "rewrites", self.prompt in ("chat", "completions"))
        # Only the three headers every route reads (`RequestHead.of`, the fastest reader).
        object.__setattr__(self, "plain_head", not (self.api_key_header or self.multipart))


# The fields of `ApiRoute.fields` in vLLM's request models: chat and completions (and their
# render routes, which take the same models) have `stream`, `stream_options` and `priority`;
# Responses and the generate routes `stream` and `priority`; Anthropic Messages and the audio
# forms `stream` only (a form is read apart, `bodies.parse_form`); the pooling routes
# (embeddings, pooling, classify, score, rerank), the batch of chat completions, generative
# scoring and `/v1/systemone` `priority` only (the default); the tokenizer routes, Messages
# `count_tokens`, `/v1/decisions` and the derender routes none. Chat, Responses and Messages
# (their render routes and `count_tokens` too) have `tools` as well.
_COMPLETIONS_FIELDS = frozenset({"stream", "stream_options", "priority"})
_CHAT_FIELDS = _COMPLETIONS_FIELDS | {"tools"}
_GENERATE_FIELDS = frozenset({"stream", "priority"})
_RESPONSES_FIELDS = _GENERATE_FIELDS | {"tools"}
_STREAM_ONLY = frozenset({"stream"})
_MESSAGES_FIELDS = _STREAM_ONLY | {"tools"}
_NO_FIELDS: frozenset[str] = frozenset()


def _routes(*routes: ApiRoute) -> dict[str, ApiRoute]:
    return {route.path: route for route in routes}


# vLLM takes its served model when a chat or completions body names none (`model_optional`).
_CHAT = ApiRoute("chat", "/v1/chat/completions", "chat", salted=True, pd_split=True, fields=_CHAT_FIELDS)
_COMPLETIONS = ApiRoute(
    "completions", "/v1/completions", "completions", salted=True, pd_split=True, fields=_COMPLETIONS_FIELDS
)


def invocation_route(body: Mapping[str, Any]) -> ApiRoute:
    """The route of a SageMaker `/invocations` body. vLLM tries its request types in order (chat,
    then completions, then the pooling ones its model supports); the gateway sends `messages` to
    chat and `prompt` to completions, so they are keyed and salted as on their own routes, and
    anything else to the worker's `/invocations`, which alone knows its model's pooling tasks."""
    if "messages" in body:
        return _CHAT
    if "prompt" in body:
        return _COMPLETIONS
    return _INVOCATIONS


# A pooling body may ask for vLLM's binary embeddings (`encoding_format` "bytes").
_INVOCATIONS = ApiRoute(
    "invocations", "/invocations", binary_answer=True, pick=invocation_route, pooled="invocations"
)


# The stored-response routes the gateway serves itself (`responses_routes`), as vLLM does: any one
# path segment is an id there, `GET /v1/responses/render` a retrieve of a response so named.
STORED_RESPONSE_PATH = "/v1/responses/{response_id}"
CANCEL_RESPONSE_PATH = STORED_RESPONSE_PATH + "/cancel"

ROUTES: dict[str, ApiRoute] = _routes(
    _CHAT,
    _COMPLETIONS,
    ApiRoute(
        "responses",
        "/v1/responses",
        "responses",
        RESPONSES,
        salted=True,
        pd_split=True,
        fields=_RESPONSES_FIELDS,
    ),
    # vLLM's Anthropic request model has no `cache_salt`; the gateway sends it anyway (see
    # docs/gateway.md, "Anthropic Messages"): builds that honour it isolate tenants, vLLM drops it.
    # Anthropic clients always name the model and send their key in `x-api-key`.
    ApiRoute(
        "messages",
        "/v1/messages",
        "messages",
        ANTHROPIC,
        salted=True,
        model_optional=False,
        api_key_header=True,
        pd_split=True,
        fields=_MESSAGES_FIELDS,
    ),
    ApiRoute(
        "count_tokens",
        "/v1/messages/count_tokens",
        None,
        ANTHROPIC,
        model_optional=False,
        api_key_header=True,
        fields=frozenset({"tools"}),
    ),
    # vLLM's batch of chat completions: `messages` is a list of conversations, each decoded once,
    # answered together as one chat completion (a choice per conversation; no stream). Load-aware:
    # the normalizer reads one conversation, and keys for one of them would describe a fraction
    # of the KV the request computes. It generates, so it is salted and takes the tenant's engine
    # priority; it runs whole on one worker (vLLM's batch refuses `kv_transfer_params` prompts).
    ApiRoute("chat_batch", "/v1/chat/completions/batch", salted=True, fanout="conversations"),
    # Rendering computes no KV: keyed, it would tell the policy that the worker now holds the
    # prompt's blocks. Load-aware, to any worker of the pool.
    ApiRoute("chat_render", "/v1/chat/completions/render", fields=_CHAT_FIELDS, scale_out=True),
    # A JSON array (one render per prompt), as SGLang's answers to a batch on `/generate` and
    # `/encode` are.
    ApiRoute(
        "completions_render",
        "/v1/completions/render",
        answer_may_be_array=True,
        fields=_COMPLETIONS_FIELDS,
        scale_out=True,
    ),
    # vLLM 0.33's other render routes take the Messages and Responses request models (a Messages
    # body always names its model and may carry its key in `x-api-key`).
    ApiRoute(
        "messages_render",
        "/v1/messages/render",
        dialect=ANTHROPIC,
        model_optional=False,
        api_key_header=True,
        fields=_MESSAGES_FIELDS,
        scale_out=True,
    ),
    ApiRoute(
        "responses_render",
        "/v1/responses/render",
        dialect=RESPONSES,
        fields=_RESPONSES_FIELDS,
        scale_out=True,
    ),
    # Derendering turns a generate answer back into a chat or completions one, without the engine.
    # Its `stream` picks the request's shape (one chunk and the client's `stream_state`), never an
    # event stream: the answer is always one JSON object, so the gateway does not read it.
    ApiRoute("chat_derender", "/v1/chat/completions/derender", fields=_NO_FIELDS, scale_out=True),
    ApiRoute("completions_derender", "/v1/completions/derender", fields=_NO_FIELDS, scale_out=True),
    # vLLM's token-in, token-out generation (`token_ids`), with `cache_salt` and
    # `kv_transfer_params`; its output budget is `sampling_params.max_tokens`.
    ApiRoute(
        "generate", "/inference/v1/generate", "generate", salted=True, pd_split=True, fields=_GENERATE_FIELDS
    ),
    # Reads rather than generations: each item or question is one prompt prefilled for one
    # token, whose label probabilities answer it (vLLM's `generative_scoring`, `structured
    # decisions` on `/v1/systemone` and OpenAI-shaped decisions on `/v1/decisions`). They fill
    # the engine's prefix cache, so they are salted; load-aware, as the normalizer has no reader
    # for their prompts. `/v1/systemone` and `/v1/decisions` refuse unknown fields, and the
    # decisions model, which always names its model, has no `priority`: it gets no engine
    # priority (vLLM would refuse the request with 400 on a pool that schedules by priority).
    # Each read prefills what its items or questions share again (the query, the state and its
    # instructions, the input): they count once per read (`prompt_batch.fanout_tokens`), and the
    # reads as sequences against `limits.max_choices`.
    ApiRoute("generative_scoring", "/generative_scoring", salted=True, fanout="items"),
    ApiRoute("structured_decisions", "/v1/systemone", salted=True, fanout="state_questions"),
    ApiRoute(
        "decisions",
        "/v1/decisions",
        salted=True,
        model_optional=False,
        fields=_NO_FIELDS,
        engine_priority=False,
        fanout="input_questions",
    ),
    _INVOCATIONS,
    # `encoding_format` "bytes" / "bytes_only": an `application/octet-stream` answer (and its
    # `metadata` header).
    # Each input is encoded on its own: the inputs count against `limits.max_pooling_inputs`.
    ApiRoute("embeddings", "/v1/embeddings", binary_answer=True, pooled="input"),
    ApiRoute("embeddings", "/v2/embed", pooled="embed_v2"),
    ApiRoute("pooling", "/pooling", binary_answer=True, pooled="input"),
    ApiRoute("classify", "/classify", pooled="input"),
    ApiRoute("classify", "/v1/classify", pooled="input"),
    ApiRoute("score", "/score", pooled="score"),
    ApiRoute("score", "/v1/score", pooled="score"),
    ApiRoute("rerank", "/rerank", pooled="rerank"),
    ApiRoute("rerank", "/v1/rerank", pooled="rerank"),
    ApiRoute("rerank", "/v2/rerank", pooled="rerank"),
    ApiRoute("tokenize", "/tokenize", fields=_NO_FIELDS),
    ApiRoute("tokenize", "/v1/tokenize", fields=_NO_FIELDS),
    ApiRoute("detokenize", "/detokenize", fields=_NO_FIELDS),
    ApiRoute("detokenize", "/v1/detokenize", fields=_NO_FIELDS),
    # SGLang's native API: `/generate` (`text` or `input_ids`) is keyed like a completions
    # prompt; its radix cache is isolated by `extra_key` ("e.g. cache_salt" in SGLang's
    # `GenerateReqInput`), which takes the tenant's salt, and it takes the `bootstrap_*` fields.
    # `/encode` is SGLang's embeddings.
    ApiRoute(
        "generate",
        "/generate",
        "generate",
        salted=True,
        salt_field="extra_key",
        answer_may_be_array=True,
        pd_split=True,
        fields=_GENERATE_FIELDS,
    ),
    ApiRoute("embeddings", "/encode", answer_may_be_array=True, pooled="encode"),
    ApiRoute(
        "transcriptions", "/v1/audio/transcriptions", multipart=True, json_answer=False, fields=_STREAM_ONLY
    ),
    ApiRoute(
        "translations", "/v1/audio/translations", multipart=True, json_answer=False, fields=_STREAM_ONLY
    ),
)
