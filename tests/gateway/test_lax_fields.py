"""The body fields the gateway reads (`stream`, `stream_options`, `priority`, `n`, `best_of`) are
read as vLLM's lax pydantic models read them, only on the routes whose model has them
(`ApiRoute.fields`): a body the worker takes is not a 400 at the gateway, and the gateway reads it
as the worker will (a `"stream": "true"` is relayed as a stream)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.bodies import parse_body, streams
from gateway.errors import ApiError
from gateway.routes import ROUTES
from tests.gateway.answer_rig import gateway
from tests.gateway.routes_rig import KEY

CHAT = ROUTES["/v1/chat/completions"]

TRUE = [True, 1, 1.0, "true", "True", "TRUE", "1", "yes", "YES", "on", "On", "t", "T", "y", "Y"]
FALSE = [False, 0, 0.0, "false", "False", "0", "no", "off", "OFF", "f", "n", "N"]
NOT_BOOL = ["maybe", 2, -1, 0.5, " true", "true ", "", "2", "1.0", [], {}]


def _chat(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


def _refused(raw: bytes, route: str = "/v1/chat/completions") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(raw, ROUTES[route])
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("value", "expected"), [(v, True) for v in TRUE] + [(v, False) for v in FALSE])
def test_stream_and_include_usage_read_as_lax_booleans(value: Any, expected: bool) -> None:
    body = parse_body(_chat(stream=value, stream_options={"include_usage": value}), CHAT)
    assert body["stream"] is expected and body["stream_options"]["include_usage"] is expected
    assert streams(body, CHAT) is expected


@pytest.mark.parametrize("value", NOT_BOOL)
def test_what_lax_mode_refuses_is_still_a_400(value: Any) -> None:
    assert _refused(_chat(stream=value)).param == "stream"
    options = {"include_usage": value}
    assert _refused(_chat(stream=True, stream_options=options)).param == "stream_options.include_usage"
    options = {"continuous_usage_stats": value}
    assert (
        _refused(_chat(stream=True, stream_options=options)).param == "stream_options.continuous_usage_stats"
    )


@pytest.mark.parametrize(("value", "expected"), [("2", 2), (" 2 ", 2), (2.0, 2), ("2.0", 2), (True, 1)])
def test_choices_and_priority_read_as_lax_integers(value: Any, expected: int) -> None:
    body = parse_body(_chat(n=value, best_of=value, priority=value), CHAT, max_choices=8)
    assert (body["n"], body["best_of"], body["priority"]) == (expected, expected, expected)
    assert all(body[name].__class__ is int for name in ("n", "best_of", "priority"))
    completions = orjson.dumps({"model": "m", "prompt": "x", "n": value})
    assert parse_body(completions, ROUTES["/v1/completions"], max_choices=8)["n"] == expected
    native = orjson.dumps({"text": "x", "sampling_params": {"n": value}})
    assert parse_body(native, ROUTES["/generate"], max_choices=8)["sampling_params"]["n"] == expected


@pytest.mark.parametrize("value", [2.5, "two", "high", None, [], "1e3"])
def test_a_priority_lax_mode_refuses_is_a_400_where_the_model_has_the_field(value: Any) -> None:
    assert _refused(_chat(priority=value)).param == "priority"
    embed = orjson.dumps({"model": "m", "input": "x", "priority": value})
    assert _refused(embed, "/v1/embeddings").param == "priority"


def test_fields_a_route_s_model_lacks_are_neither_checked_nor_read() -> None:
    # vLLM's embeddings, tokenizer and count_tokens models have no `stream` / `stream_options`;
    # extra fields are allowed there, so the worker ignores them and answers 200.
    embed = parse_body(orjson.dumps({"model": "m", "input": "x", "stream": "no"}), ROUTES["/v1/embeddings"])
    assert embed["stream"] == "no" and not streams(embed, ROUTES["/v1/embeddings"])
    on = parse_body(orjson.dumps({"model": "m", "input": "x", "stream": True}), ROUTES["/v1/embeddings"])
    assert not streams(on, ROUTES["/v1/embeddings"])  # an embedding is one JSON answer
    raw = orjson.dumps({"model": "m", "prompt": "x", "stream_options": [], "stream": 7, "priority": "high"})
    tokenize = parse_body(raw, ROUTES["/tokenize"])
    assert tokenize["stream_options"] == [] and tokenize["stream"] == 7
    assert "priority" not in tokenize  # unread, and dropped on its way as every priority there
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "x"})
    assert parse_body(raw, ROUTES["/v1/messages/count_tokens"])["stream"] == "x"
    assert _refused(raw, "/v1/messages").param == "stream"  # Messages has the field


async def test_through_the_gateway_lax_values_reach_the_worker_and_stream(emulator: str) -> None:
    async with gateway(emulator, "lean") as (gw, _):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "true",
                "n": "2", "max_tokens": 3}  # fmt: skip
        resp = await gw.client.post("/v1/chat/completions", json=body, headers=KEY)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.content.rstrip().endswith(b"data: [DONE]")
        for path, extra in (("/v1/embeddings", {"input": "x", "stream": "no"}),
                            ("/tokenize", {"prompt": "x", "stream_options": []})):  # fmt: skip
            resp = await gw.client.post(path, json={"model": "m", **extra}, headers=KEY)
            assert resp.status_code == 200, (path, resp.text)
