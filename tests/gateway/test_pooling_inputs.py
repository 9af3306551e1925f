"""The inputs of a pooling request are bounded (`limits.max_pooling_inputs`, 2,048 by default as
in OpenAI's embeddings API): a short body of many inputs (5,000 one-character embeddings are
25 KB) would keep a worker busy for seconds and answer more than the answer cap. A rerank's query
counts in the prompt tokens once per document, as a read's shared fields do.

The gateway runs in-process in front of scripted workers (`routes_worker`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.keying import INLINE_PROMPT_BYTES
from tests.gateway.routes_rig import KEY, Rig, routes_rig

_CAP = 4


def _many(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


# Each pooling route, a body of `n` inputs, and the field the refusal names.
_BODIES: dict[str, tuple[Any, str]] = {
    "/v1/embeddings": (lambda n: {"input": _many(n)}, "input"),
    "/pooling": (lambda n: {"input": [[1, 2]] * n}, "input"),  # token-id lists, one input each
    "/classify": (lambda n: {"input": _many(n)}, "input"),
    "/v1/classify": (lambda n: {"input": _many(n)}, "input"),
    "/v2/embed": (lambda n: {"texts": _many(n - 1), "images": ["data:,"], "input_type": "x"}, "texts"),
    "/encode": (lambda n: {"text": _many(n)}, "text"),
    "/score": (lambda n: {"text_1": "q", "text_2": _many(n)}, "text_2"),
    "/v1/score": (lambda n: {"queries": _many(n), "documents": _many(n)}, "documents"),
    "/rerank": (lambda n: {"query": "q", "documents": _many(n)}, "documents"),
    "/v1/rerank": (lambda n: {"query": "q", "documents": _many(n)}, "documents"),
    "/v2/rerank": (lambda n: {"query": "q", "documents": _many(n)}, "documents"),
    "/invocations": (lambda n: {"input": _many(n)}, "input"),
}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with routes_rig(limits={"max_body_bytes": 1 << 20, "max_pooling_inputs": _CAP}) as rig:
        yield rig


@pytest.mark.parametrize("path", list(_BODIES))
async def test_a_pooling_request_of_more_inputs_than_the_limit_is_refused(rig: Rig, path: str) -> None:
    build, field = _BODIES[path]
    resp = await rig.client.post(path, json={"model": "m", **build(_CAP)}, headers=KEY)
    assert resp.status_code == 200, resp.text
    resp = await rig.client.post(path, json={"model": "m", **build(_CAP + 1)}, headers=KEY)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("array_above_max_length", field)
    assert f"{_CAP + 1} inputs" in error["message"] and f"at most {_CAP}" in error["message"]
    assert sum(len(w.received) for w in rig.workers) == 1  # only the request within the limit


async def test_one_input_in_any_shape_counts_once(rig: Rig) -> None:
    for body in (
        {"input": "x" * 100},
        {"input": list(range(100))},  # the token ids of one input
        {"messages": [{"role": "user", "content": "x"}] * 10},  # one conversation
    ):
        resp = await rig.client.post("/v1/embeddings", json={"model": "m", **body}, headers=KEY)
        assert resp.status_code == 200, resp.text


async def test_a_large_body_read_in_the_keying_process_is_bounded_too(rig: Rig) -> None:
    body = {"model": "m", "input": ["x"] * 70_000}
    assert len(orjson.dumps(body)) > INLINE_PROMPT_BYTES  # read apart (`keying.keyed_apart`)
    resp = await rig.client.post("/v1/embeddings", json=body, headers=KEY)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "array_above_max_length"
    assert not any(w.received for w in rig.workers)


async def test_the_default_limit_is_openais_2048_inputs() -> None:
    async with routes_rig(limits={"max_body_bytes": 1 << 20}) as rig:
        ok = await rig.client.post("/v1/embeddings", json={"model": "m", "input": ["x"] * 2048}, headers=KEY)
        assert ok.status_code == 200
        resp = await rig.client.post(
            "/v1/embeddings", json={"model": "m", "input": ["x"] * 5000}, headers=KEY
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"


async def test_a_rerank_query_counts_once_per_document(rig: Rig) -> None:
    query = "q" * 400  # 100 tokens at the pool's 4 characters a token
    body = {"model": "m", "query": query, "documents": ["d"] * _CAP}
    assert (await rig.client.post("/v1/rerank", json=body, headers=KEY)).status_code == 200
    body_tokens = len(orjson.dumps(body)) // 4
    assert rig.policy.requests[-1].n_prompt_tokens == body_tokens + (_CAP - 1) * 100
    body = {"model": "m", "text_1": query, "text_2": ["d"] * _CAP}
    assert (await rig.client.post("/score", json=body, headers=KEY)).status_code == 200
    assert rig.policy.requests[-1].n_prompt_tokens == len(orjson.dumps(body)) // 4 + (_CAP - 1) * 100
    # Pairs given side by side repeat nothing.
    body = {"model": "m", "text_1": [query] * 2, "text_2": ["d"] * 2}
    assert (await rig.client.post("/score", json=body, headers=KEY)).status_code == 200
    assert rig.policy.requests[-1].n_prompt_tokens == len(orjson.dumps(body)) // 4


async def test_documents_are_bounded_with_or_without_a_query_and_through_invocations(rig: Rig) -> None:
    for path, body in (
        ("/v1/rerank", {"documents": _many(_CAP + 1)}),  # no query: still the worker's work to refuse
        ("/invocations", {"query": "q", "documents": _many(_CAP + 1)}),
        ("/invocations", {"text_1": "q", "text_2": _many(_CAP + 1)}),
    ):
        resp = await rig.client.post(path, json={"model": "m", **body}, headers=KEY)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "array_above_max_length", path
    body = {"model": "m", "query": "q" * 400, "documents": ["d"] * _CAP}
    assert (await rig.client.post("/invocations", json=body, headers=KEY)).status_code == 200
    assert rig.policy.requests[-1].n_prompt_tokens == len(orjson.dumps(body)) // 4 + (_CAP - 1) * 100
