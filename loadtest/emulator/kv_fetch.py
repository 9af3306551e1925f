"""Decode side of a KV transfer: ask the prefill worker for the prompt's KV over HTTP.

The emulated workers are separate processes, so the decode worker reaches the prefill worker on
two small internal routes (`routes_kv.py`): vLLM style, `POST /kvgate/kv/pull` names the held
transfer (`remote_request_id`, `remote_engine_id`); SGLang style, `GET
/kvgate/kv/bootstrap/{room}` registers the decode side in the room and waits until the prefill
has run. Either answers how many of the prompt's tokens the prefill worker holds. The bytes
themselves are not sent: their transfer time is modelled by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from loadtest.emulator.pd_protocol import Bootstrap, RemotePrefill

PULL_PATH = "/kvgate/kv/pull"
BOOTSTRAP_PATH = "/kvgate/kv/bootstrap"


class TransferFailed(Exception):
    """The prefill worker could not hand over the KV (gone, unknown transfer, timed out)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What the prefill worker holds for this request."""

    engine_id: str
    num_prompt_tokens: int  # the prompt it prefilled
    num_tokens: int  # the leading prompt tokens whose KV it still holds


async def fetch(
    client: httpx.AsyncClient, source: RemotePrefill | Bootstrap, tokens: int, timeout_s: float
) -> Offer:
    """Ask the prefill worker for the KV of `tokens` prompt tokens; TransferFailed if it cannot."""
    try:
        if isinstance(source, RemotePrefill):
            url = f"http://{_host(source.host)}:{source.port}{PULL_PATH}"
            body = {"request_id": source.request_id, "engine_id": source.engine_id, "tokens": tokens}
            resp = await client.post(url, json=body, timeout=timeout_s)
        else:
            if source.port is None:
                raise TransferFailed(
                    "bootstrap_port is null: the prefill worker's bootstrap server is unknown"
                )
            url = f"http://{_host(source.host)}:{source.port}{BOOTSTRAP_PATH}/{source.room}"
            params: dict[str, str | int] = {"tokens": tokens, "timeout_s": f"{timeout_s:.3f}"}
            # The prefill answers once its prompt has run: wait a little longer than it may.
            resp = await client.get(url, params=params, timeout=timeout_s + 5.0)
    except httpx.TransportError as exc:
        raise TransferFailed(
            f"failed to get the KV cache from the prefill worker at {source.host}:{source.port}, "
            f"it might be dead ({type(exc).__name__})"
        ) from exc
    if resp.status_code != 200:
        raise TransferFailed(_refusal(source, resp))
    try:
        data = resp.json()
        offer = Offer(str(data["engine_id"]), int(data["num_prompt_tokens"]), int(data["num_tokens"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferFailed("the prefill worker's answer is malformed") from exc
    if isinstance(source, RemotePrefill) and offer.engine_id != source.engine_id:
        raise TransferFailed("the prefill worker is another engine than remote_engine_id")
    return offer


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _refusal(source: RemotePrefill | Bootstrap, resp: httpx.Response) -> str:
    what = (
        f"remote_request_id {source.request_id}"
        if isinstance(source, RemotePrefill)
        else f"bootstrap_room {source.room}"
    )
    reasons = {
        404: "holds no KV for",
        409: "refused (engine id or room already taken) for",
        410: "failed the prefill of",
        504: "timed out waiting for the prefill of",
    }
    return f"the prefill worker {reasons.get(resp.status_code, f'answered {resp.status_code} for')} {what}"
