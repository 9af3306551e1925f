"""A large body read and keyed in the keying process gives exactly what admission's own calls give.

The keying process's function (`large_body.key_body`) runs here in process, its answer is rebuilt
and its drift observed as `keying.read_large_body` does, and every output is compared with
`parse_body`, the route's pick, `encode_body` and `Normalizer.canonicalize` run directly: over the
seeded equivalence corpus under every approximate-mode config (pieces made tiny so that every body
is split), over sessions of converted (Responses) requests, and on a few large bodies.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest

from gateway import large_body
from gateway.bodies import encode_body, parse_body
from gateway.errors import ApiError
from gateway.keying_pool import Turns, rebuild
from gateway.large_body import BodyJob, ModelKeying, key_body, pieces
from gateway.routes import ROUTES
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from tests.prompt_normalizer.equivalence_corpus import IDENTITIES, PUBLIC, SECRET, corpus
from tests.prompt_normalizer.equivalence_records import prompt_record

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "invocations": "/invocations",
}
APPROXIMATE = {
    "demo": NormalizerConfig(),
    "rules_ws_sort": NormalizerConfig(chars_per_token=3, whitespace=True, tool_order="sort"),
    "raw_fewshot": NormalizerConfig(canonical_json=False, unicode_nfc=False, session_fields=("user",)),
    "small_limits": NormalizerConfig(
        chars_per_token=1, max_input_chars=6000, drift_sessions_max=3, drift_store_max_blocks=400
    ),
}


def inline(raw: bytes, path: str, norm: Normalizer, identity: int, public: bool) -> Any:
    """What admission computes on the event loop for this body (model "m" keyed)."""
    api = ROUTES[path]
    try:
        body = parse_body(raw, api)
        if api.pick is not None:
            api = api.pick(body)
        encoded = encode_body(body)
    except ApiError as exc:
        return ["error", exc.status, exc.message, exc.code, exc.param]
    out: list[Any] = [api.path, body, encoded]
    if api.prompt is None or (body.get("model") or "m") != "m":
        return out
    try:
        prompt = norm.canonicalize(
            api.prompt, body, IDENTITIES[identity], PUBLIC[identity] if public else None
        )
    except NormalizerError as exc:
        return [*out, "prompt_error", exc.message, exc.code, exc.param]
    return [*out, prompt_record(prompt)]


async def through_process(
    raw: bytes, path: str, norm: Normalizer, config: NormalizerConfig, identity: int, public: bool
) -> Any:
    """The same through the keying process's function, rebuilt and observed as the loop does."""
    models = {"m": ModelKeying(config, IDENTITIES[identity], PUBLIC[identity] if public else None)}
    keyed = key_body(BodyJob(raw, path, 128, SECRET, models, "m"))
    if keyed.error is not None:
        status, message, _, code, param = keyed.error
        return ["error", status, message, code, param]
    assert keyed.body is not None
    turns = Turns()
    out: list[Any] = [keyed.path, await rebuild(keyed.body, turns), keyed.encoded]
    if keyed.prompt_error is not None:
        return [*out, "prompt_error", *keyed.prompt_error]
    if keyed.canonical is None:
        return out
    prompt = keyed.canonical
    if keyed.canonical_body is not None:
        prompt = dataclasses.replace(prompt, canonical_body=await rebuild(keyed.canonical_body, turns))
    if keyed.pending is not None:
        prompt = norm.observe_pending(prompt, keyed.pending)
    return [*out, prompt_record(prompt)]


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(large_body, "PIECE_BYTES", 48)  # every body split into many pieces


@pytest.mark.parametrize("name", list(APPROXIMATE))
async def test_the_corpus_keys_the_same_through_the_keying_process(name: str, tiny_pieces: None) -> None:
    config = APPROXIMATE[name]
    here, there = Normalizer(config, SECRET), Normalizer(config, SECRET)
    compared = 0
    for case in corpus():
        try:
            raw = orjson.dumps(case.body)
        except TypeError:
            continue  # not JSON: no client can send it
        path = PATHS[case.endpoint]
        expected = inline(raw, path, here, case.identity, case.public)
        got = await through_process(raw, path, there, config, case.identity, case.public)
        assert got == expected
        assert repr(got) == repr(expected)  # key order and types too
        compared += 1
    assert compared > 250


def _responses_turns(n: int, changed: int | None = None) -> bytes:
    items = [
        {
            "role": "user" if i % 2 else "assistant",
            "content": f"turn {i} " + ("CHANGED" if i == changed else "x" * 40),
        }
        for i in range(n)
    ]
    return orjson.dumps({"model": "m", "input": items, "instructions": "be brief", "user": "u-7"})


async def test_a_converted_sessions_drift_is_named_by_its_own_field(tiny_pieces: None) -> None:
    config = NormalizerConfig()
    here, there = Normalizer(config, SECRET), Normalizer(config, SECRET)
    seen = []
    for raw in (_responses_turns(6), _responses_turns(8), _responses_turns(8, changed=3)):
        expected = inline(raw, "/v1/responses", here, 0, True)
        assert await through_process(raw, "/v1/responses", there, config, 0, True) == expected
        seen.append(expected[-1])
    drift = seen[-1][8]
    assert drift[1] is not None and drift[5].startswith("input[3]")  # the field, relabelled


def _large_bodies() -> dict[str, bytes]:
    pixels = "A" * 1000  # as many images as a request may carry, each a data URL of 1 KB
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}{pixels}"}} for i in range(2048)
    ]
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"q{i} x"} for i in range(20_000)]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}
    tools = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    return {
        "images": orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}),
        "messages": orjson.dumps({"model": "m", "messages": turns, "user": "u-1", "cache_salt": "mine"}),
        "text": orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "lörem " * 200_000}]}),
        "tools": orjson.dumps(
            {"model": "m", "messages": tools * 5000, "tools": [{"function": {"name": "f"}}]}
        ),
        "invocations": orjson.dumps({"messages": turns}),
        "pass_through": orjson.dumps({"model": "m", "input": ["a b c"] * 100_000}),
    }


@pytest.mark.parametrize("shape", list(_large_bodies()))
async def test_large_bodies_key_the_same_through_the_keying_process(shape: str) -> None:
    config = NormalizerConfig()
    here, there = Normalizer(config, SECRET), Normalizer(config, SECRET)
    raw = _large_bodies()[shape]
    path = {"invocations": "/invocations", "pass_through": "/v1/embeddings"}.get(
        shape, "/v1/chat/completions"
    )
    for _ in range(2):  # the second meets the session and the remembered spans
        expected = inline(raw, path, here, 1, True)
        got = await through_process(raw, path, there, config, 1, True)
        assert got == expected and repr(got) == repr(expected)


def test_pieces_parse_back_to_an_equal_value_in_order() -> None:
    value = {
        "z": list(range(30_000)),
        "a": {"k" + str(i): [i, {"x": "y" * (i % 7)}] for i in range(10_000)},
        "s": "é" * 200_000,
        "e": [],
        "n": [[1.5, -0.0, None, True, 2**63 - 1]] * 5000,
    }
    rebuilt = asyncio.run(rebuild(pieces(value), Turns()))
    assert rebuilt == value and orjson.dumps(rebuilt) == orjson.dumps(value)


async def test_a_bad_body_is_refused_as_admission_refuses_it() -> None:
    config = NormalizerConfig()
    norm = Normalizer(config, SECRET)
    for raw in (
        b"{",
        b"[1]",
        b'{"model": "m"}',
        b'{"model": "m", "messages": [], "n": 1000}',
        b'{"model": "m", "prompt": 7}',
    ):
        for path in ("/v1/chat/completions", "/v1/completions"):
            assert await through_process(raw, path, norm, config, 0, False) == inline(
                raw, path, norm, 0, False
            )
