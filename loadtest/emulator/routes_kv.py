"""Internal routes a decode worker calls on a prefill worker to take over a prompt's KV.

    POST /kvgate/kv/pull               {"request_id", "engine_id", "tokens"}  (vLLM style)
    GET  /kvgate/kv/bootstrap/{room}   ?tokens=N&timeout_s=T                  (SGLang style)

Both answer `{"engine_id", "num_prompt_tokens", "num_tokens"}`: the prompt the prefill worker
ran and how many of its leading tokens' KV it holds. Refusals: 404 unknown or expired transfer,
409 another engine or a room already taken, 410 the prefill failed, 504 no prefill in time.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loadtest.emulator.errors import ApiError
from loadtest.emulator.kv_fetch import BOOTSTRAP_PATH, PULL_PATH
from loadtest.emulator.kv_transfer import KvTransfers
from loadtest.emulator.pd_protocol import MAX_ROOM
from loadtest.emulator.web import json_response, read_json

router = APIRouter()
MAX_WAIT_S = 3600.0


def transfers_of(request: Request) -> KvTransfers:
    """The app's KV transfers (set by the lifespan)."""
    kv: KvTransfers = request.app.state.kv
    return kv


def _tokens(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError.bad_request("tokens must be a non-negative integer", "tokens")
    return value


@router.post(PULL_PATH)
async def pull(request: Request) -> Response:
    body = await read_json(request)
    transfer_id, engine_id = body.get("request_id"), body.get("engine_id")
    if not isinstance(transfer_id, str) or not isinstance(engine_id, str):
        raise ApiError.bad_request("request_id and engine_id must be strings")
    status, answer = transfers_of(request).pull(transfer_id, engine_id, _tokens(body.get("tokens")))
    return json_response(answer, status)


@router.get(BOOTSTRAP_PATH + "/{room}")
async def bootstrap(request: Request, room: int) -> Response:
    try:
        tokens = _tokens(int(request.query_params.get("tokens", "0")))
        timeout_s = float(request.query_params.get("timeout_s", "30"))
    except ValueError as exc:
        raise ApiError.bad_request("tokens and timeout_s must be numbers") from exc
    if not math.isfinite(timeout_s) or timeout_s <= 0 or not 0 <= room < MAX_ROOM:
        raise ApiError.bad_request("timeout_s must be positive and room in [0, 2^64)")
    status, answer = await transfers_of(request).serve_bootstrap(room, tokens, min(timeout_s, MAX_WAIT_S))
    return json_response(answer, status)
