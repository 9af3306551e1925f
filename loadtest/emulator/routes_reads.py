"""vLLM's reads: requests answered by the probabilities of a few label tokens after a prompt,
each prompt prefilled for one token (`max_tokens` 1), never by generated text.

- `POST /generative_scoring`: one read per item (the query then the item, or the reverse with
  `item_first`); each item's score is its first label's probability. Id `generative-scoring-<id>`.
- `POST /v1/systemone` (vLLM's structured decisions): one read per question about `state`;
  answers keyed by question id, with `diagnostics`. Id `decision-<id>`. Unknown fields refused.
- `POST /v1/decisions` (OpenAI-shaped decisions): one read per question about `input`; answers
  in question order, usage in Responses' shape; no id, no `priority`, no `request_id`, and
  unknown fields refused, as vLLM's `extra="forbid"` model does.

The probabilities are the emulator's own (the first label the likeliest); what matters is the
shape, the ids, the engine work (every read of a request shares its state's prefix) and the
fields vLLM refuses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from loadtest.emulator import chat_bodies
from loadtest.emulator.base_request_id import base_request_id
from loadtest.emulator.errors import ApiError, RequestValidationError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.prompts import prompt_batch
from loadtest.emulator.protocol import check_model, common_fields, one_answer_request
from loadtest.emulator.web import json_response, read_json, wait_finished, worker_of

router = APIRouter()

_LABEL_MASS = 0.9  # the labels' share of the vocabulary's probability, in every read
_SYSTEMONE_FIELDS = frozenset(
    {
        "model",
        "state",
        "questions",
        "instructions",
        "images",
        "audio",
        "videos",
        "chat_template_kwargs",
        "joint",
        "cache_salt",
        "priority",
        "request_id",
    }
)
_DECISIONS_FIELDS = frozenset({"model", "input", "questions", "safety_identifier", "joint", "cache_salt"})


def _forbid_extras(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise RequestValidationError(
                {"type": "extra_forbidden", "loc": ["body", name], "msg": "Extra inputs are not permitted"}
            )


def _probabilities(k: int) -> list[float]:
    """`k` label probabilities summing to 1, the first the likeliest."""
    weights = [float(k - i) for i in range(k)]
    total = sum(weights)
    return [weight / total for weight in weights]


async def _read(request: Request, body: Mapping[str, Any], texts: list[str]) -> LiveGroup | Response:
    """Run one read per prompt text; the finished group, or the 499 answer of a client gone."""
    w = worker_of(request)
    common = common_fields(
        {name: body[name] for name in ("model", "cache_salt", "priority") if name in body}, w.cfg
    )
    prompts = prompt_batch(texts, w.tokenizer, "questions")
    gen = one_answer_request("completions", common, prompts[0], 1, None)
    group = w.submit(dataclasses.replace(gen, prompts=prompts), "read")
    gone = await wait_finished(request, w, group)
    return gone if gone is not None else group


def _usage(group: LiveGroup) -> tuple[int, int, int]:
    """Prompt tokens, cached prompt tokens and output tokens of every read of `group`."""
    usage = chat_bodies.usage(group)
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


@router.post("/generative_scoring")
async def generative_scoring(request: Request) -> Response:
    body = await read_json(request)
    model = check_model(body, worker_of(request).cfg)
    query, items, labels = body.get("query"), body.get("items"), body.get("label_token_ids")
    if not isinstance(query, str | list) or not query:
        raise ApiError.bad_request("query must be a string or a list of token ids", "query")
    if not isinstance(items, list) or not items:
        raise ApiError.bad_request("items must be a non-empty list", "items")
    if not isinstance(labels, list) or not labels or not all(isinstance(t, int) for t in labels):
        raise ApiError.bad_request("label_token_ids must be a non-empty list of token ids", "label_token_ids")
    if not all(isinstance(item, str) for item in items) or not isinstance(query, str):
        raise ApiError.bad_request("the emulator scores text queries and items only", "items")
    first = body.get("item_first") is True
    texts = [item + query if first else query + item for item in items]
    rid = f"generative-scoring-{base_request_id(request, body.get('request_id'))}"
    read = await _read(request, body, texts)
    if isinstance(read, Response):
        return read
    score = _probabilities(len(labels))[0]
    prompt, _, output = _usage(read)
    return json_response(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": score} for i in range(len(items))],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + output, "completion_tokens": output},
        }
    )


def _systemone_answer(question: Mapping[str, Any], qid: str) -> dict[str, Any]:
    kind, criteria = question.get("type"), question.get("criteria")
    if kind == "choice" and isinstance(criteria, dict) and criteria:
        probs = _probabilities(len(criteria))
        names = [str(name) for name in criteria]
        return {
            "type": "choice",
            "choice": names[0],
            "probabilities": dict(zip(names, probs, strict=True)),
            "confidence": probs[0] * _LABEL_MASS,
        }
    if kind == "noul" and (criteria is None or isinstance(criteria, dict)):
        yes, no = _probabilities(2)
        return {
            "type": "noul",
            "noul": yes,
            "probabilities": {"yes": yes, "no": no},
            "confidence": yes * _LABEL_MASS,
        }
    if kind == "score" and isinstance(criteria, list) and len(criteria) >= 2:
        probs = _probabilities(len(criteria))
        return {
            "type": "score",
            "score": sum(i * p for i, p in enumerate(probs)),
            "legend": {str(i): str(level) for i, level in enumerate(criteria)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": probs[0] * _LABEL_MASS,
        }
    raise ApiError.bad_request(f"question {qid!r}: unknown type or criteria")


@router.post("/v1/systemone")
async def structured_decision(request: Request) -> Response:
    body = await read_json(request)
    _forbid_extras(body, _SYSTEMONE_FIELDS)
    model = check_model(body, worker_of(request).cfg)
    questions = body.get("questions")
    if "state" not in body or not isinstance(questions, dict) or not questions:
        raise ApiError.bad_request("state and a non-empty questions object are required", "questions")
    answers = {qid: _systemone_answer(q if isinstance(q, dict) else {}, qid) for qid, q in questions.items()}
    state = body["state"] if isinstance(body["state"], str) else orjson.dumps(body["state"]).decode()
    rid = f"decision-{base_request_id(request, body.get('request_id'))}"
    read = await _read(request, body, [f"{state}\n{q.get('instructions', '')}" for q in questions.values()])
    if isinstance(read, Response):
        return read
    prompt, _, output = _usage(read)
    diagnostics = {qid: {"label_mass": _LABEL_MASS, "argmax_is_label": True} for qid in questions}
    return json_response(
        {
            "id": rid,
            "object": "structured_decision",
            "created": int(time.time()),
            "model": model,
            "answers": answers,
            "usage": {"input_tokens": prompt, "output_tokens": output},
            "diagnostics": diagnostics,
            "joint": None,
        }
    )


def _input_text(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        parts: list[str] = []
        for message in value:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            else:
                raise ApiError.bad_request("every input message needs content", "input")
        return "\n".join(parts)
    raise ApiError.bad_request("input must be text or a list of user messages", "input")


def _decision_answer(question: Mapping[str, Any]) -> dict[str, Any]:
    kind, name = question.get("type"), question.get("name")
    if kind == "predicate":
        return {"type": "predicate", "name": name, "probability": _probabilities(2)[0]}
    if kind == "choice" and isinstance(choices := question.get("choices"), list) and len(choices) >= 2:
        probs = _probabilities(len(choices))
        values = [c.get("value") if isinstance(c, dict) else None for c in choices]
        return {
            "type": "choice",
            "name": name,
            "choice": values[0],
            "probabilities": [{"value": v, "probability": p} for v, p in zip(values, probs, strict=True)],
            "confidence": probs[0] * _LABEL_MASS,
        }
    if kind == "score" and isinstance(levels := question.get("levels"), list) and len(levels) >= 2:
        probs = _probabilities(len(levels))
        labels = [str(level.get("label")) if isinstance(level, dict) else "" for level in levels]
        return {
            "type": "score",
            "name": name,
            "score": sum(i * p for i, p in enumerate(probs)),
            "probabilities": [
                {"value": i, "label": label, "probability": p}
                for i, (label, p) in enumerate(zip(labels, probs, strict=True))
            ],
            "confidence": probs[0] * _LABEL_MASS,
        }
    raise ApiError.bad_request("every question needs a known type and its options", "questions")


@router.post("/v1/decisions")
async def decisions(request: Request) -> Response:
    body = await read_json(request)
    _forbid_extras(body, _DECISIONS_FIELDS)
    if "model" not in body:
        raise RequestValidationError({"type": "missing", "loc": ["body", "model"], "msg": "Field required"})
    model = check_model(body, worker_of(request).cfg)
    questions = body.get("questions")
    if not isinstance(questions, list) or not questions:
        raise ApiError.bad_request("questions must be a non-empty list", "questions")
    answers = [_decision_answer(q if isinstance(q, dict) else {}) for q in questions]
    text = _input_text(body.get("input"))
    read = await _read(request, body, [f"{text}\n{q.get('instructions', '')}" for q in questions])
    if isinstance(read, Response):
        return read
    prompt, cached, output = _usage(read)
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
    return json_response({"model": model, "answers": answers, "usage": usage})
