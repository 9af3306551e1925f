"""P/D request fields and the decode side's fetch, without processes: what each body makes a
worker do, and how the prefill worker's refusals become transfer failures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from loadtest.emulator.errors import ApiError
from loadtest.emulator.kv_fetch import Offer, TransferFailed, fetch
from loadtest.emulator.pd_protocol import (
    Bootstrap,
    RemoteDecode,
    RemotePrefill,
    kv_transfer_params,
    parse_pd,
)

REMOTE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P0",
          "remote_request_id": "t1", "remote_host": "10.0.0.5", "remote_port": 8100,
          "remote_block_ids": [3, 4, 5], "tp_size": 1}  # fmt: skip
BOOT = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 42}


def test_vllm_params_pick_the_side_in_every_role() -> None:
    for role in ("prefill", "decode", "mixed"):
        assert parse_pd({"kv_transfer_params": {"do_remote_decode": True}}, role) == RemoteDecode()
        assert parse_pd({"kv_transfer_params": REMOTE}, role) == RemotePrefill(
            "P0", "t1", "10.0.0.5", 8100, 3
        )
    assert parse_pd({"kv_transfer_params": None}, "decode") is None
    assert parse_pd({"kv_transfer_params": {"do_remote_prefill": False}}, "decode") is None


def test_the_params_a_prefill_returns_round_trip() -> None:
    params = kv_transfer_params("P0", "t9", "127.0.0.1", 8100, num_prompt_tokens=33, block_size=16)
    assert params["remote_block_ids"] == [0, 1, 2]  # the partial last block is listed too
    assert parse_pd({"kv_transfer_params": params}, "decode") == RemotePrefill(
        "P0", "t9", "127.0.0.1", 8100, 3
    )


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port"])
def test_remote_prefill_without_an_address_is_computed_locally(missing: str) -> None:
    params = {k: v for k, v in REMOTE.items() if k != missing}
    assert parse_pd({"kv_transfer_params": params}, "decode") is None  # vLLM: invalid params, no transfer


def test_malformed_params_are_refused() -> None:
    with pytest.raises(ApiError) as err:
        parse_pd({"kv_transfer_params": "yes"}, "decode")
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"


def test_bootstrap_fields_act_on_prefill_and_decode_roles_only() -> None:
    assert parse_pd(BOOT, "prefill") == Bootstrap("10.0.0.5", 8998, 42)
    assert parse_pd(BOOT, "decode") == Bootstrap("10.0.0.5", 8998, 42)
    assert parse_pd(BOOT, "mixed") is None  # SGLang's non-disaggregated server ignores them
    batched = {"bootstrap_host": ["h"], "bootstrap_port": [None], "bootstrap_room": [7]}
    assert parse_pd(batched, "decode") == Bootstrap("h", None, 7)


@pytest.mark.parametrize(
    ("field", "value"),
    [("bootstrap_room", -1), ("bootstrap_room", 2**64), ("bootstrap_room", True), ("bootstrap_port", 0),
     ("bootstrap_port", "8998"), ("bootstrap_host", ""), ("bootstrap_room", [1, 2])],
)  # fmt: skip
def test_bad_bootstrap_fields_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as err:
        parse_pd({**BOOT, field: value}, "decode")
    assert err.value.status == 400 and err.value.param == field


def run_fetch(handler: Any, source: RemotePrefill | Bootstrap) -> Offer:
    async def go() -> Offer:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await fetch(client, source, 100, 1.0)

    return asyncio.run(go())


def answer(status: int, body: dict[str, Any]) -> Any:
    return lambda request: httpx.Response(status, json=body)


OFFER = {"engine_id": "P0", "num_prompt_tokens": 100, "num_tokens": 100}
PULL = RemotePrefill("P0", "t1", "10.0.0.5", 8100, 7)


def test_fetch_reads_the_offer_from_either_route() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url}")
        return httpx.Response(200, json=OFFER)

    assert run_fetch(handler, PULL) == Offer("P0", 100, 100)
    run_fetch(handler, Bootstrap("10.0.0.5", 8998, 42))
    assert seen[0] == "POST http://10.0.0.5:8100/kvgate/kv/pull"
    assert seen[1].startswith("GET http://10.0.0.5:8998/kvgate/kv/bootstrap/42?tokens=100&timeout_s=")


@pytest.mark.parametrize(
    ("status", "says"),
    [
        (404, "holds no KV"),
        (409, "refused"),
        (410, "failed the prefill"),
        (504, "timed out"),
        (500, "answered 500"),
    ],
)
def test_refusals_become_transfer_failures(status: int, says: str) -> None:
    with pytest.raises(TransferFailed, match=says):
        run_fetch(answer(status, {"error": {}}), PULL)


def test_another_engine_a_malformed_answer_and_an_unknown_bootstrap_port_fail() -> None:
    with pytest.raises(TransferFailed, match="another engine"):
        run_fetch(answer(200, {**OFFER, "engine_id": "P1"}), PULL)
    with pytest.raises(TransferFailed, match="malformed"):
        run_fetch(answer(200, {"engine_id": "P0"}), PULL)
    with pytest.raises(TransferFailed, match="bootstrap_port is null"):
        run_fetch(answer(200, OFFER), Bootstrap("h", None, 1))


def test_an_unreachable_prefill_worker_fails_the_transfer() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(TransferFailed, match="it might be dead"):
        run_fetch(refuse, PULL)
