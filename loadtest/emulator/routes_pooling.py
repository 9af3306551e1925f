"""Pooling routes, as vLLM serves them for embedding, classification and cross-encoder models:
`/v1/embeddings`, `/pooling`, `/classify`, `/score` (+ `/v1/score`), `/rerank` (+ `/v1/rerank`,
`/v2/rerank`). Cheap: vectors come from `pooling.Pooler`, not from the engine model; inputs are
validated and counted like prompts (each within `max_model_len`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from loadtest.emulator.errors import ApiError
from loadtest.emulator.pooling import (
    CLASS_LABELS,
    EMBED_DTYPES,
    EMBEDDING_DIM,
    ENDIANNESS,
    Pooler,
    encode_vector,
    vector_bytes,
)
from loadtest.emulator.prompts import prompt_batch
from loadtest.emulator.protocol import check_model, int_field, render_chat_body
from loadtest.emulator.web import json_response, read_json, worker_of
from loadtest.emulator.worker import EmulatedWorker

router = APIRouter()


def _fit(ids: np.ndarray, body: Mapping[str, Any], w: EmulatedWorker, param: str) -> np.ndarray:
    """Apply vLLM's `truncate_prompt_tokens` (keep the last k; -1 = max_model_len), then check
    the length against `max_model_len`."""
    keep = body.get("truncate_prompt_tokens")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1 or keep == 0:
            raise ApiError.bad_request("truncate_prompt_tokens must be -1 or a positive integer", param)
        ids = ids[-(w.max_model_len if keep == -1 else keep) :]
    if len(ids) > w.max_model_len:
        raise ApiError.bad_request(
            f"This model's maximum context length is {w.max_model_len} tokens. However, you requested "
            f"{len(ids)} tokens in the input for embedding generation. "
            "Please reduce the length of the input.",
            param,
        )
    return ids


def _inputs(body: Mapping[str, Any], w: EmulatedWorker) -> list[np.ndarray]:
    """`input` (string, token ids, or a list of either) or chat `messages` (one input)."""
    ids: tuple[np.ndarray, ...]
    if "messages" in body:
        ids = (w.tokenizer.encode(render_chat_body(body)),)
    else:
        ids = prompt_batch(body.get("input"), w.tokenizer, "input")
    return [_fit(x, body, w, "input") for x in ids]


def _texts(value: Any, param: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise ApiError.bad_request(f"{param} must be a non-empty string or a list of them", param)
    return items


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


_FORMATS = ("float", "base64", "bytes", "bytes_only")
_BINARY = ("bytes", "bytes_only")


def _encoding(body: Mapping[str, Any]) -> tuple[str, str, int]:
    fmt = body.get("encoding_format", "float")
    if fmt not in _FORMATS:
        raise ApiError.bad_request(f"encoding_format must be one of {', '.join(_FORMATS)}", "encoding_format")
    if body.get("endianness", "native") not in ENDIANNESS:
        raise ApiError.bad_request(f"endianness must be one of {', '.join(ENDIANNESS)}", "endianness")
    dtype = body.get("embed_dtype", "float32")
    if dtype not in EMBED_DTYPES:
        raise ApiError.bad_request(f"embed_dtype must be one of {', '.join(EMBED_DTYPES)}", "embed_dtype")
    dims = int_field(body, "dimensions", 1, EMBEDDING_DIM) or EMBEDDING_DIM
    return str(fmt), str(dtype), dims


def _list_body(prefix: str, model: str, data: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(prompt_tokens),
    }


_Item = Callable[[Pooler, np.ndarray], dict[str, Any]]
"""Builds the item one tokenized input answers with (its `index` is added by the handler)."""


def _vectors(object_name: str, field_name: str) -> Callable[[Mapping[str, Any]], _Item]:
    def items(body: Mapping[str, Any]) -> _Item:
        fmt, dtype, dims = _encoding(body)
        if fmt in _BINARY:
            return lambda pooler, ids: {"vector": pooler.embed(ids, dims)}
        return lambda pooler, ids: {
            "object": object_name,
            field_name: encode_vector(pooler.embed(ids, dims), fmt, dtype),
        }

    return items


def _binary_answer(
    body: Mapping[str, Any], answer_id: str, model: str, data: list[dict[str, Any]], prompt_tokens: int
) -> Response:
    """vLLM's `encoding_format` "bytes" and "bytes_only" (`_openai_bytes_response` in
    vllm/entrypoints/pooling/embed/serving.py, the offsets as `encode_pooling_bytes` in
    vllm/entrypoints/pooling/utils.py lays them out): the vectors back to back as raw
    `embed_dtype` values in `endianness` order, `application/octet-stream`; with "bytes", a
    `metadata` header holding a JSON object: `id`, `created`, `model`, `usage`, and in `data` one
    item per input with its `index`, `embed_dtype`, `endianness`, `start` and `end` (byte offsets
    into the body) and `shape`. "bytes_only" sends no header."""
    dtype = str(body.get("embed_dtype", "float32"))
    endianness = str(body.get("endianness", "native"))
    chunks: list[bytes] = []
    items: list[dict[str, Any]] = []
    offset = 0
    for item in data:
        vec = item["vector"]
        raw = vector_bytes(vec, dtype, endianness)
        items.append(
            {"index": item["index"], "embed_dtype": dtype, "endianness": endianness,
             "start": offset, "end": offset + len(raw), "shape": list(vec.shape)}
        )  # fmt: skip
        chunks.append(raw)
        offset += len(raw)
    headers = None
    if body.get("encoding_format") == "bytes":
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        meta = {"id": answer_id, "created": int(time.time()), "model": model, "data": items, "usage": usage}
        headers = {"metadata": json.dumps(meta)}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)


def _classes(body: Mapping[str, Any]) -> _Item:
    def item(pooler: Pooler, ids: np.ndarray) -> dict[str, Any]:
        probs = pooler.classify(ids)
        return {
            "label": CLASS_LABELS[int(np.argmax(probs))],
            "probs": probs.astype(np.float64).tolist(),
            "num_classes": len(probs),
        }

    return item


@dataclass(frozen=True, slots=True)
class _PerInputRoute:
    """A route that answers each input with one item, in a vLLM list body. `items` reads the
    route's own options first, so a bad option is rejected before any input is tokenized.
    `vectors`: its items are vectors, which `encoding_format` "bytes" sends as a binary body."""

    path: str
    id_prefix: str
    items: Callable[[Mapping[str, Any]], _Item]
    vectors: bool = True


_PER_INPUT_ROUTES = (
    _PerInputRoute("/v1/embeddings", "embd", _vectors("embedding", "embedding")),
    _PerInputRoute("/pooling", "pool", _vectors("pooling", "data")),
    _PerInputRoute("/classify", "classify", _classes, vectors=False),
)


def _per_input_handler(route: _PerInputRoute) -> Callable[[Request], Awaitable[Response]]:
    async def handler(request: Request) -> Response:
        body = await read_json(request)
        w = worker_of(request)
        model = check_model(body, w.cfg)
        item = route.items(body)
        inputs = _inputs(body, w)
        data = [{"index": i, **item(w.pooler, ids)} for i, ids in enumerate(inputs)]
        prompt_tokens = sum(len(x) for x in inputs)
        if route.vectors and body.get("encoding_format") in _BINARY:
            answer_id = f"{route.id_prefix}-{uuid.uuid4().hex}"
            return _binary_answer(body, answer_id, model, data, prompt_tokens)
        return json_response(_list_body(route.id_prefix, model, data, prompt_tokens))

    return handler


for _route in _PER_INPUT_ROUTES:
    router.add_api_route(_route.path, _per_input_handler(_route), methods=["POST"], name=_route.id_prefix)


def _encode_all(w: EmulatedWorker, body: Mapping[str, Any], texts: list[str], param: str) -> list[np.ndarray]:
    return [_fit(w.tokenizer.encode(t), body, w, param) for t in texts]


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    model = check_model(body, w.cfg)
    first, second = ("queries", "documents") if "queries" in body else ("text_1", "text_2")
    left = _encode_all(w, body, _texts(body.get(first), first), first)
    right = _encode_all(w, body, _texts(body.get(second), second), second)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ApiError.bad_request(
            f"{first} and {second} must pair 1:1, 1:N or N:N (got {len(left)} and {len(right)})", second
        )
    pooler = w.pooler
    data = [
        {"index": i, "object": "score", "score": pooler.score(a, b)}
        for i, (a, b) in enumerate(zip(left, right, strict=True))
    ]
    tokens = sum(len(a) + len(b) for a, b in zip(left, right, strict=True))
    return json_response(_list_body("score", model, data, tokens))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    model = check_model(body, w.cfg)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ApiError.bad_request("query must be a non-empty string", "query")
    raw_docs = body.get("documents")
    docs = (
        [d.get("text") if isinstance(d, Mapping) else d for d in raw_docs]
        if isinstance(raw_docs, list)
        else raw_docs
    )
    texts = _texts(docs, "documents")
    top_n = int_field(body, "top_n", 0) or len(texts)
    q = _fit(w.tokenizer.encode(query), body, w, "query")
    doc_ids = _encode_all(w, body, texts, "documents")
    pooler = w.pooler
    scored = sorted(
        ((pooler.score(q, d), i) for i, d in enumerate(doc_ids)), key=lambda item: (-item[0], item[1])
    )
    results = [{"index": i, "document": {"text": texts[i]}, "relevance_score": s} for s, i in scored[:top_n]]
    tokens = sum(len(q) + len(d) for d in doc_ids)
    return json_response(
        {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}
    )  # fmt: skip
