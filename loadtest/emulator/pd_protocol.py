"""The prefill/decode fields of a chat or completions body, parsed into what the worker does.

vLLM (NIXL connector): `kv_transfer_params` with `do_remote_decode` makes this worker the prefill
side of a transfer (`RemoteDecode`); with `do_remote_prefill` and the `remote_*` fields a prefill
worker returned, the decode side (`RemotePrefill`). Every role honours them per request, as
vLLM's connector does; `do_remote_prefill` without the remote fields is computed locally (vLLM
logs "Got invalid KVTransferParams"). SGLang: `bootstrap_host`, `bootstrap_port`,
`bootstrap_room` (`Bootstrap`) act on a prefill-role or decode-role worker; a mixed worker is
SGLang's non-disaggregated server and ignores them. See docs/pd.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loadtest.emulator.config import Role
from loadtest.emulator.errors import ApiError

log = logging.getLogger("loadtest.emulator.pd")
MAX_ROOM = 2**64  # SGLang draws rooms in [0, 2^63); anything an unsigned 64-bit int holds is taken


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """vLLM prefill leg: keep this prompt's KV for a decode worker to pull."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """vLLM decode leg: the prompt's KV sits on the prefill worker these fields name."""

    engine_id: str
    request_id: str
    host: str
    port: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """SGLang: the prefill worker's bootstrap address and the room both workers meet in."""

    host: str
    port: int | None
    room: int


PdRole = RemoteDecode | RemotePrefill | Bootstrap


def parse_pd(body: Mapping[str, Any], role: Role) -> PdRole | None:
    """What this worker does for the request's P/D fields; None for a plain request."""
    kv = _kv_transfer_params(body)
    if kv is not None:
        return kv
    if role == "mixed" or "bootstrap_room" not in body:
        return None
    return _bootstrap(body)


def check_single_sequence(n: int, num_prompts: int, param: str) -> None:
    """A transfer carries one prompt's KV: P/D requests run one sequence (n = 1, one prompt)."""
    if n != 1 or num_prompts != 1:
        raise ApiError.bad_request(
            "prefill/decode disaggregation serves one sequence per request (n = 1, one prompt)", param
        )


def _kv_transfer_params(body: Mapping[str, Any]) -> RemoteDecode | RemotePrefill | None:
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ApiError.bad_request("kv_transfer_params must be an object", "kv_transfer_params")
    if params.get("do_remote_decode") is True:
        return RemoteDecode()
    if params.get("do_remote_prefill") is not True:
        return None
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    host = params.get("remote_host")
    port = params.get("remote_port")
    block_ids = params.get("remote_block_ids")
    valid = (
        isinstance(engine_id, str)
        and isinstance(request_id, str)
        and isinstance(host, str)
        and isinstance(port, int)
        and not isinstance(port, bool)
        and 0 < port < 65536
        and isinstance(block_ids, list)
        and len(block_ids) > 0
    )
    if not valid:
        # vLLM: "Got invalid KVTransferParams ... This request will not utilize KVTransfer".
        log.warning("kv_transfer_params without a usable remote address: the prompt is computed locally")
        return None
    assert isinstance(engine_id, str) and isinstance(request_id, str) and isinstance(host, str)
    assert isinstance(port, int) and isinstance(block_ids, list)
    return RemotePrefill(engine_id, request_id, host, port, len(block_ids))


def _one(body: Mapping[str, Any], name: str) -> Any:
    """A bootstrap field; routers send a list (one entry per sequence) for batches."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != 1:
            raise ApiError.bad_request(
                "prefill/decode disaggregation serves one sequence per request (n = 1, one prompt)", name
            )
        return value[0]
    return value


def _bootstrap(body: Mapping[str, Any]) -> Bootstrap:
    host = _one(body, "bootstrap_host")
    port = _one(body, "bootstrap_port")
    room = _one(body, "bootstrap_room")
    if not isinstance(host, str) or not host:
        raise ApiError.bad_request("bootstrap_host must be a non-empty string", "bootstrap_host")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ApiError.bad_request("bootstrap_port must be a port number or null", "bootstrap_port")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise ApiError.bad_request("bootstrap_room must be an integer in [0, 2^64)", "bootstrap_room")
    return Bootstrap(host, port, room)


def kv_transfer_params(
    engine_id: str, request_id: str, host: str, port: int, num_prompt_tokens: int, block_size: int
) -> dict[str, object]:
    """The `kv_transfer_params` a vLLM prefill server returns (NIXL connector version 2).

    Block ids are opaque to everyone but the engine that owns them; one per block of the prompt,
    its partial last block included, as vLLM lists them.
    """
    num_blocks = -(-num_prompt_tokens // block_size)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(num_blocks)),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }
