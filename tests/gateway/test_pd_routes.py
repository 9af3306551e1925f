"""Which routes a prefill/decode pool splits: only generation is sent as a prefill leg and a
decode leg; every other route (embeddings, pooling, scores, tokenizer, render, audio, SageMaker's
pooling `/invocations`) runs whole on one worker that serves it alone, with no
`kv_transfer_params` or `bootstrap_*` fields.

The gateway runs in-process in front of scripted workers (`routes_worker`) in prefill, decode
and mixed roles, each recording what it received."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.routes import ROUTES
from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import gateway_in_process
from tests.support.wait import wait_until

_PD_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")

# Every route that does not generate, with a body its worker takes.
_WHOLE: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": "x"},
    "/v2/embed": {"texts": ["x"], "input_type": "search_document"},
    "/encode": {"text": "x"},
    "/pooling": {"input": "x"},
    "/classify": {"input": "x"},
    "/v1/classify": {"input": "x"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/rerank": {"query": "q", "documents": ["d"]},
    "/v1/rerank": {"query": "q", "documents": ["d"]},
    "/v2/rerank": {"query": "q", "documents": ["d"]},
    "/tokenize": {"prompt": "x"},
    "/v1/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "x"}]},
    "/v1/completions/render": {"prompt": "x"},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "x"}]},
    "/invocations": {"input": "x"},  # a pooling body: the worker's own /invocations
    # vLLM 0.33's batch of chat completions runs whole (vLLM's batch refuses a pre-tokenized
    # `kv_transfer_params` prompt), as do its reads, render and derender routes.
    "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "x"}]]},
    "/generative_scoring": {"query": "q", "items": ["a"], "label_token_ids": [1]},
    "/v1/systemone": {"state": "s", "questions": {"q": {"type": "noul"}}},
    "/v1/decisions": {"input": "s", "questions": [{"type": "predicate", "instructions": "?"}]},
    "/v1/messages/render": {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    "/v1/responses/render": {"input": "x"},
    "/v1/chat/completions/derender": {"generate_response": {"choices": []}},
    "/v1/completions/derender": {"generate_responses": []},
}
_AUDIO = ("/v1/audio/transcriptions", "/v1/audio/translations")


@dataclass
class PdRig:
    client: httpx.AsyncClient
    prefill: RoutesWorker
    decode: RoutesWorker
    mixed: RoutesWorker | None

    def workers(self) -> list[RoutesWorker]:
        return [w for w in (self.prefill, self.decode, self.mixed) if w is not None]

    def clear(self) -> None:
        for worker in self.workers():
            worker.received.clear()

    def arrivals(self, path: str) -> list[tuple[str, dict[str, Any]]]:
        """(worker name, JSON body or {}) of every request that reached `path`."""
        found = []
        for worker in self.workers():
            for got in worker.received:
                if got.path == path:
                    body = (
                        got.json()
                        if got.headers.get("content-type", "").startswith("application/json")
                        else {}
                    )
                    found.append((worker.name, body))
        return found


@contextlib.asynccontextmanager
async def pd_rig(protocol: str, *, mixed: bool = False) -> AsyncIterator[PdRig]:
    prefill, decode = RoutesWorker("prefill"), RoutesWorker("decode")
    lone = RoutesWorker("mixed") if mixed else None
    workers = [w for w in (prefill, decode, lone) if w is not None]
    runners = [await start(w) for w in workers]
    pool: dict[str, Any] = {
        "name": "p",
        "models": ["m"],
        "prefill_workers": [prefill.url],
        "decode_workers": [decode.url],
        "workers": [lone.url] if lone is not None else [],
        # A pair whenever one is free: a request that is split here is split every time.
        "pd": {"protocol": protocol, "conditional": False, "bootstrap_port": 8998},
        "retry_attempts": 0,
    }
    cfg = config([], limits={"max_body_bytes": 1 << 20})
    cfg["pools"] = [pool]
    try:
        async with gateway_in_process(cfg, Recording(), secret=SECRET) as gw:
            registry = gw.state.registry.pools["p"]
            await wait_until(lambda: all(w.healthy for w in registry.workers.values()))
            yield PdRig(gw.client, prefill, decode, lone)
    finally:
        for runner in runners:
            await runner.cleanup()


def _chat() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def _post(rig: PdRig, path: str, body: dict[str, Any]) -> httpx.Response:
    return await rig.client.post(path, json={"model": "m", **body}, headers=KEY)


async def _audio(rig: PdRig, path: str) -> httpx.Response:
    files = {"file": ("a.wav", b"RIFF....", "audio/wav")}
    return await rig.client.post(path, data={"model": "m"}, files=files, headers=KEY)


def test_every_route_is_either_split_or_whole() -> None:
    generating = {path for path, route in ROUTES.items() if route.pd_split}
    assert generating == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/inference/v1/generate",
        "/generate",
    }
    assert set(_WHOLE) | set(_AUDIO) == set(ROUTES) - generating


async def test_vllm_sends_every_other_route_whole_to_a_decode_worker() -> None:
    async with pd_rig("vllm") as rig:
        resp = await _post(rig, "/v1/chat/completions", _chat())
        assert resp.status_code == 200
        legs = rig.arrivals("/v1/chat/completions")
        assert [name for name, _ in legs] == ["prefill", "decode"]  # chat is still split
        assert legs[0][1]["kv_transfer_params"]["do_remote_decode"] is True
        for path, body in _WHOLE.items():
            rig.clear()
            resp = await _post(rig, path, body)
            assert resp.status_code == 200, (path, resp.text)
            legs = rig.arrivals(path)
            assert [name for name, _ in legs] == ["decode"], path
            assert not any(field in legs[0][1] for field in _PD_FIELDS), path
        for path in _AUDIO:
            rig.clear()
            assert (await _audio(rig, path)).status_code == 200, path
            assert [name for name, _ in rig.arrivals(path)] == ["decode"], path


@pytest.mark.parametrize("mixed", [True, False])
async def test_sglang_sends_every_other_route_whole_but_never_to_a_decode_worker(mixed: bool) -> None:
    """SGLang's decode servers take only paired requests: a mixed worker serves the others, or,
    in a pool without one, a prefill worker."""
    lone = "mixed" if mixed else "prefill"
    async with pd_rig("sglang", mixed=mixed) as rig:
        assert (await _post(rig, "/v1/chat/completions", _chat())).status_code == 200
        legs = rig.arrivals("/v1/chat/completions")
        assert sorted(name for name, _ in legs) == ["decode", "prefill"]
        assert all("bootstrap_room" in body for _, body in legs)
        for path, body in _WHOLE.items():
            rig.clear()
            resp = await _post(rig, path, body)
            assert resp.status_code == 200, (path, resp.text)
            legs = rig.arrivals(path)
            assert [name for name, _ in legs] == [lone], path
            assert not any(field in legs[0][1] for field in _PD_FIELDS), path


async def test_the_native_generate_routes_are_split() -> None:
    """vLLM's tokens-in route carries `kv_transfer_params`, its one-token budget in
    `sampling_params`; SGLang's `/generate` carries the `bootstrap_*` fields."""
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, "min_tokens": 2}}
    async with pd_rig("vllm") as rig:
        assert (await _post(rig, "/inference/v1/generate", body)).status_code == 200
        (p, prefill), (d, decode) = rig.arrivals("/inference/v1/generate")
        assert (p, d) == ("prefill", "decode")
        assert prefill["sampling_params"] == {"max_tokens": 1} and "max_tokens" not in prefill
        assert prefill["kv_transfer_params"]["do_remote_decode"] is True
        assert decode["sampling_params"] == body["sampling_params"]
    async with pd_rig("sglang") as rig:
        assert (await _post(rig, "/generate", {"text": "hello"})).status_code == 200
        legs = rig.arrivals("/generate")
        assert sorted(name for name, _ in legs) == ["decode", "prefill"]
        assert all("bootstrap_room" in body for _, body in legs)
