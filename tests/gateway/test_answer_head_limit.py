"""A worker answer's head is bounded the same on both upstream transports
(`upstream_conn.MAX_ANSWER_HEAD_BYTES`): vLLM's binary embeddings, whose `metadata` header lists
every input's offsets, pass through well past aiohttp's default 8 KB header line (what https
workers are read with), and a head past the bound is a malformed answer on either transport."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from gateway.transport import MAX_ANSWER_HEADERS
from gateway.upstream_conn import MAX_ANSWER_HEAD_BYTES
from policies.base import Outcome
from tests.gateway.answer_rig import answering, gateway
from tests.gateway.routes_rig import KEY
from tests.support.transports import TRANSPORTS


def _metadata(inputs: int) -> str:
    """vLLM's `metadata` header for `inputs` embeddings: each input's place in the body."""
    data = [
        {"index": i, "object": "embedding", "start": i * 4096, "end": (i + 1) * 4096} for i in range(inputs)
    ]
    return orjson.dumps({"id": "embd-1", "object": "list", "model": "m", "data": data}).decode()


def embeddings_worker(metadata: str) -> contextlib.AbstractAsyncContextManager[str]:
    headers = {"content-type": "application/octet-stream", "metadata": metadata}
    return answering(["/v1/embeddings"], b"\0" * 64, headers)


_BODY = {"model": "m", "input": ["x"], "encoding_format": "bytes"}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_large_metadata_header_passes_through(transport: str) -> None:
    metadata = _metadata(2000)
    assert 8 * 1024 < len(metadata) < MAX_ANSWER_HEAD_BYTES // 2
    async with embeddings_worker(metadata) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/v1/embeddings", json=_BODY, headers=KEY)
        assert resp.status_code == 200, resp.text
        assert resp.headers["metadata"] == metadata
        assert resp.headers["content-type"] == "application/octet-stream"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.SERVED


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_head_past_the_bound_is_a_malformed_answer(transport: str) -> None:
    metadata = "x" * (MAX_ANSWER_HEAD_BYTES + 1)
    async with embeddings_worker(metadata) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/v1/embeddings", json=_BODY, headers=KEY)
        assert resp.status_code == 502, resp.text
        assert orjson.loads(resp.content)["error"]["code"] == "bad_gateway"
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_many_large_headers_are_a_malformed_answer(transport: str) -> None:
    """aiohttp bounds a head per line, so https answers bound the number of headers as well: 80
    headers of 512 KiB (40 MiB) are refused on either transport, as one head past 1 MiB is."""
    many = {f"x-filler-{i}": "y" * (512 * 1024) for i in range(MAX_ANSWER_HEADERS + 16)}
    headers = {"content-type": "application/json", **many}
    async with answering(["/v1/embeddings"], b"{}", headers) as url, gateway(url, transport) as (gw, policy):
        resp = await gw.client.post("/v1/embeddings", json=_BODY, headers=KEY)
        assert resp.status_code == 502, resp.text
        (obs,) = policy.observations
        assert obs.outcome is Outcome.WORKER_FAILED
