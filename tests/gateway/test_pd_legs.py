"""The pieces of a split request that need no worker: which requests can be split, and the
client's `cached_tokens` taken from the prefill worker in whole answers and streams."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson
import pytest

from gateway.answer_usage import Usage
from gateway.failure import Failure
from gateway.pd_legs import Opened, PdRelay, Prefilled, TransferFailed, both_legs, with_cached_tokens
from gateway.pd_requests import splittable
from policies.base import Outcome


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": []}, True),
        ({"n": 1, "prompt": "x"}, True),
        ({"prompt": [1, 2, 3]}, True),  # one tokenized prompt
        ({"prompt": ["only one"]}, True),
        ({"n": 2}, False),
        ({"best_of": 3, "prompt": "x"}, False),
        ({"prompt": ["a", "b"]}, False),
        ({"prompt": [[1, 2], [3]]}, False),
        ({"n": True}, True),  # not a count; the worker judges it
        # The native generate routes: SGLang's `/generate`, vLLM's `/inference/v1/generate`.
        ({"text": "x", "sampling_params": {"max_new_tokens": 4}}, True),
        ({"text": ["only one"]}, True),
        ({"input_ids": [1, 2, 3]}, True),
        ({"token_ids": [1, 2, 3], "sampling_params": {"n": 1}}, True),
        ({"text": ["a", "b"]}, False),
        ({"input_ids": [[1, 2], [3]]}, False),
        ({"text": "x", "sampling_params": {"n": 2}}, False),
        ({"token_ids": [1, 2], "sampling_params": {"best_of": 2}}, False),
    ],
)
def test_only_one_sequence_is_split(body: dict[str, Any], expected: bool) -> None:
    assert splittable(body) is expected


def test_the_answer_reports_the_given_cached_tokens() -> None:
    answer = {"id": "x", "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 99}}}
    out = orjson.loads(with_cached_tokens(orjson.dumps(answer), 48))
    assert out["usage"] == {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 48}}
    no_details = orjson.loads(with_cached_tokens(b'{"usage": {"prompt_tokens": 3}}', 0))
    assert no_details["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    for unchanged in (b'{"usage": null}', b"not json", b"[1]", b'{"choices": []}'):
        assert with_cached_tokens(unchanged, 5) == unchanged
    # Anthropic Messages: the field its clients read, `input_tokens` the uncached rest of the same
    # prompt (vLLM reports the whole prompt there and no cache fields).
    for usage in ({"input_tokens": 1, "cache_read_input_tokens": 99}, {"input_tokens": 100}):
        out = orjson.loads(
            with_cached_tokens(orjson.dumps({"type": "message", "usage": usage}), 48, "anthropic")
        )
        assert out["usage"] == {"input_tokens": 52, "cache_read_input_tokens": 48}
    created = {"input_tokens": 0, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 10}
    out = orjson.loads(with_cached_tokens(orjson.dumps({"usage": created}), 95, "anthropic"))
    assert out["usage"] == {
        "input_tokens": 0,
        "cache_read_input_tokens": 90,
        "cache_creation_input_tokens": 10,
    }
    # Responses: its own details field, nothing of another API's.
    responses = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 99}, "output_tokens": 2}
    out = orjson.loads(with_cached_tokens(orjson.dumps({"usage": responses}), 48, "responses"))
    assert out["usage"] == {**responses, "input_tokens_details": {"cached_tokens": 48}}


def _events(*payloads: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


def test_the_stream_relay_rewrites_the_usage_chunk_once_it_knows_the_hit() -> None:
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 99}}
    chunks = ({"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": usage})
    relay = PdRelay(strip_usage=False)
    relay.cached_tokens = 32
    out = relay.feed(_events(*chunks))
    assert b'"cached_tokens":32' in out and b'"content":"hi"' in out and relay.done
    assert relay.usage["prompt_tokens_details"]["cached_tokens"] == 32  # what the books record
    # Unknown hit (the prefill answer had no usage): the decode worker's figure stays.
    plain = PdRelay(strip_usage=True)
    assert plain.feed(_events(*chunks)).count(b"data:") == 2  # the usage chunk the client did not ask for
    assert plain.usage["prompt_tokens_details"]["cached_tokens"] == 99


async def _leg(result: object, gate: asyncio.Event | None = None, stopped: list[str] | None = None) -> Any:
    """A leg that ends with `result` once `gate` opens (at once without one); records a stop."""
    try:
        if gate is not None:
            await gate.wait()
        return result
    except asyncio.CancelledError:
        if stopped is not None:
            stopped.append("stopped")
        raise


async def test_sglang_legs_wait_for_the_decode_answer_and_a_failure_stops_the_other() -> None:
    ok_p, ok_d = Prefilled(None, Usage(10, 1, 0)), Opened(cast(Any, None), 200, "text/event-stream")
    failed = Failure(502, "boom", "bad_gateway", Outcome.WORKER_FAILED)
    # The prefill leg answers first: both results once the decode leg answers.
    gate = asyncio.Event()
    p_task = asyncio.create_task(_leg(ok_p))
    d_task = asyncio.create_task(_leg(ok_d, gate))
    waiting = asyncio.create_task(both_legs(p_task, d_task))
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.set()
    assert await waiting == (ok_p, ok_d)
    # The decode answer opens first: it is returned at once, the prefill leg left running.
    gate = asyncio.Event()
    p_task = asyncio.create_task(_leg(ok_p, gate))
    d_task = asyncio.create_task(_leg(ok_d))
    assert await both_legs(p_task, d_task) == (None, ok_d)
    assert not p_task.done()
    gate.set()
    assert await p_task == ok_p
    # The decode leg fails first: the prefill leg (waiting for its room) is stopped.
    stopped: list[str] = []
    p_task = asyncio.create_task(_leg(ok_p, asyncio.Event(), stopped))
    d_task = asyncio.create_task(_leg(TransferFailed(failed, "decode_error")))
    assert await both_legs(p_task, d_task) == (None, TransferFailed(failed, "decode_error"))
    assert stopped == ["stopped"]
    # The prefill leg fails: the decode leg is stopped.
    stopped.clear()
    p_task = asyncio.create_task(_leg(failed))
    d_task = asyncio.create_task(_leg(ok_d, asyncio.Event(), stopped))
    assert await both_legs(p_task, d_task) == (failed, None) and stopped == ["stopped"]
