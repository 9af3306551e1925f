"""Usage in a chat or completions stream the gateway relays. The gateway asks the worker for
usage whatever the client asked (it learns from `cached_tokens`) and strips what the client did
not ask for; it never turns on vLLM's per-chunk usage (`continuous_usage_stats`) for a client
that did not ask for usage, and a client that asked gets what vLLM itself would send."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.bodies import asks_usage, forced_usage
from gateway.sse import SseRelay
from tests.gateway.answer_rig import answering, gateway
from tests.gateway.routes_rig import KEY

MAX_TOKENS = 4


@pytest.mark.parametrize(
    ("options", "asked"),
    [
        (None, False),
        ({}, False),
        ({"include_usage": True}, True),
        ({"include_usage": False}, False),
        ({"include_usage": None, "continuous_usage_stats": True}, False),
        ({"include_usage": False, "continuous_usage_stats": True}, False),
        # vLLM 0.33: include_usage defaults to false, and continuous_usage_stats needs it.
        ({"continuous_usage_stats": True}, False),
        ({"continuous_usage_stats": False}, False),
    ],
)
def test_which_stream_options_ask_for_usage(options: dict[str, Any] | None, asked: bool) -> None:
    assert asks_usage(options) is asked
    if not asked:
        forced = forced_usage(options)
        assert forced["include_usage"] is True and "continuous_usage_stats" not in forced


def test_forced_usage_keeps_the_client_s_other_options() -> None:
    options = {"include_usage": False, "continuous_usage_stats": True, "include_obfuscation": False}
    assert forced_usage(options) == {"include_usage": True, "include_obfuscation": False}
    assert options["continuous_usage_stats"] is True  # the client's body is not changed


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _content(i: int) -> dict[str, Any]:
    usage = {"prompt_tokens": 3, "completion_tokens": i, "total_tokens": 3 + i}
    return {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}], "usage": usage}


FINAL = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}  # fmt: skip


def test_a_relay_stripping_usage_strips_it_from_answer_chunks_too() -> None:
    # vLLM with --enable-force-include-usage puts usage on every chunk whatever was asked.
    relay = SseRelay(strip_usage=True)
    out = relay.feed(_event(_content(1)) + _event(_content(2)) + _event(FINAL) + b"data: [DONE]\n\n")
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events == [{"choices": _content(i)["choices"]} for i in (1, 2)]
    assert relay.usage == FINAL["usage"] and relay.content_events == 2 and relay.done


def test_a_relay_keeps_per_chunk_usage_the_client_asked_for() -> None:
    relay = SseRelay(strip_usage=False)
    stream = _event(_content(1)) + _event(_content(2)) + _event(FINAL) + b"data: [DONE]\n\n"
    assert relay.feed(stream) == stream
    assert relay.usage == FINAL["usage"] and relay.content_events == 2


def _usage_pattern(content: bytes) -> list[str]:
    """Each chunk of a stream as `usage` (an answer chunk with usage), `final` (the usage-only
    chunk) or `-` (no usage)."""
    events = [e[6:] for e in content.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    out = []
    for chunk in map(orjson.loads, events[:-1]):
        assert chunk.get("usage", 0) is not None  # no `"usage": null`
        out.append("-" if "usage" not in chunk else "usage" if chunk["choices"] else "final")
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, ["-"] * MAX_TOKENS),
        ({"include_usage": True}, ["-"] * MAX_TOKENS + ["final"]),
        ({"include_usage": False, "continuous_usage_stats": True}, ["-"] * MAX_TOKENS),
        ({"include_usage": "false", "continuous_usage_stats": "yes"}, ["-"] * MAX_TOKENS),
        ({"include_usage": True, "continuous_usage_stats": True}, ["usage"] * MAX_TOKENS + ["final"]),
        # No usage for the client, as from vLLM; the gateway still gets its own (the observation).
        ({"continuous_usage_stats": True}, ["-"] * MAX_TOKENS),
        ({"continuous_usage_stats": "1"}, ["-"] * MAX_TOKENS),
        ({}, ["-"] * MAX_TOKENS),
    ],
)
async def test_the_client_gets_the_usage_it_asked_for_as_from_vllm(
    emulator: str, path: str, options: dict[str, Any] | None, expected: list[str]
) -> None:
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    if options is not None:
        body["stream_options"] = options
    async with gateway(emulator, "lean") as (gw, policy):
        resp = await gw.client.post(path, json=body, headers=KEY)
        assert resp.status_code == 200, resp.text
        assert _usage_pattern(resp.content) == expected
        async with httpx.AsyncClient(timeout=30) as client:  # the worker itself
            direct = await client.post(emulator + path, json=body)
        assert _usage_pattern(direct.content) == expected
        (obs,) = policy.observations
        assert obs.completion_tokens == MAX_TOKENS and obs.cached_tokens is not None


# A faulty worker's usage chunk: its `usage` is not an object. Before, only `"usage":{` made the
# relay look inside a chunk, so such a chunk reached a client that had not asked for usage.
MALFORMED = [[1, 2], 5, "x", True, {}]


def _malformed_stream(usage: object, pretty: bool = False) -> bytes:
    final: dict[str, Any] = {"id": "c1", "choices": [], "usage": usage}
    chunk = orjson.dumps(final) if not pretty else orjson.dumps(final).replace(b'":', b'": ')
    return _event(_content(1) | {"usage": None}) + b"data: " + chunk + b"\n\n" + b"data: [DONE]\n\n"


@pytest.mark.parametrize("pretty", [False, True], ids=["compact", "spaced"])
@pytest.mark.parametrize("usage", MALFORMED, ids=["array", "number", "string", "true", "empty"])
@pytest.mark.parametrize("piece", [1, 7, 100_000])
def test_a_relay_stripping_usage_drops_a_usage_chunk_whatever_its_usage_holds(
    usage: object, pretty: bool, piece: int
) -> None:
    stream = _malformed_stream(usage, pretty)
    relay = SseRelay(strip_usage=True)
    out = b"".join(relay.feed(stream[i : i + piece]) for i in range(0, len(stream), piece))
    assert out == _event(_content(1) | {"usage": None}) + b"data: [DONE]\n\n"
    assert relay.usage == usage and relay.content_events == 1 and relay.done
    kept = SseRelay(strip_usage=False)  # asked for, it is the client's as the worker sent it
    assert kept.feed(stream) == stream and kept.usage == usage


def test_a_null_usage_is_no_usage_chunk() -> None:
    # OpenAI's API asked for usage puts `"usage": null` on every chunk of the answer but the
    # last: such a chunk passes untouched, unparsed, even one without choices.
    stream = _malformed_stream(None) + _malformed_stream(None, pretty=True)
    relay = SseRelay(strip_usage=True)
    assert relay.feed(stream) == stream and relay.usage is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("usage", MALFORMED, ids=["array", "number", "string", "true", "empty"])
async def test_the_gateway_strips_a_malformed_usage_chunk_the_client_did_not_ask_for(
    path: str, usage: object
) -> None:
    stream = _malformed_stream(usage)
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    worker = answering([path], stream, {"content-type": "text/event-stream"})
    async with worker as url, gateway(url, "lean") as (gw, _):
        resp = await gw.client.post(path, json=body, headers=KEY)
        assert resp.status_code == 200, resp.text
        chunks = [orjson.loads(e[6:]) for e in resp.content.split(b"\n\n") if e.startswith(b"data: {")]
        assert [c["choices"] for c in chunks] == [_content(1)["choices"]]
        assert all(c.get("usage") is None for c in chunks)
        asked = {**body, "stream_options": {"include_usage": True}}
        resp = await gw.client.post(path, json=asked, headers=KEY)
        assert resp.content == stream  # asked for, it is relayed as the worker sent it
