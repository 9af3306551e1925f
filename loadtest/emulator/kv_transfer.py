"""Prefill/decode disaggregation in the emulated worker: both sides of a KV transfer.

Prefill side. A vLLM-style request (`do_remote_decode`) runs as asked; when it finishes its
prompt blocks are *held* (pinned in the engine, counted as used KV) under a transfer id and the
answer carries `kv_transfer_params` naming this worker. The hold ends when a decode worker has
read it (after the modelled transfer time) or after `kv_hold_timeout_s` (vLLM's
`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`; counted as expired). An SGLang-style request on a
prefill-role worker first waits (`kv_bootstrap_timeout_s`) for its decode worker to register the
bootstrap room, then prefills one token and holds the blocks the same way.

Decode side. The worker finds its own prefix hit, asks the prefill worker for the rest
(`kv_fetch`), waits `StepProfile.kv_transfer_s` of the tokens that move, installs the prompt's
full blocks in its prefix cache (BlockStored events) and submits the request with the received
tokens as external: it starts with prompt - 1 computed and reports them cached, as vLLM does.
A transfer that fails or would end after `kv_transfer_timeout_s` fails: the request is answered
500 (`kv_load_failure_policy` fail) or prefilled locally (recompute).

Registries are bounded and every wait has a timeout. Timeouts are real seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.kv_fetch import TransferFailed, fetch
from loadtest.emulator.live import LiveGroup, LiveRequest
from loadtest.emulator.metrics import TransferStats
from loadtest.emulator.pd_protocol import (
    Bootstrap,
    RemoteDecode,
    RemotePrefill,
    check_single_sequence,
    kv_transfer_params,
    parse_pd,
)
from loadtest.emulator.protocol import GenerationRequest
from loadtest.emulator.worker import EmulatedWorker
from loadtest.engine import block_hashes

log = logging.getLogger("loadtest.emulator.pd")
MAX_PENDING = 65536  # held transfers and open bootstrap rooms, each
FinishHook = Callable[[LiveRequest], None]


@dataclass(slots=True)
class ProducerTicket:
    """Links a prefill request's finish hook to its answer (set once the group exists)."""

    group: LiveGroup | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """How to run a chat or completions request after its P/D fields were acted on."""

    gen: GenerationRequest
    external_tokens: int = 0
    on_finish: FinishHook | None = None
    ticket: ProducerTicket | None = None
    failure: ApiError | None = None  # the transfer failed under kv_load_failure_policy "fail"


@dataclass(slots=True)
class _Held:
    """Prompt KV pinned on the prefill side until its decode worker has read it."""

    num_prompt_tokens: int
    num_tokens: int
    expiry: asyncio.TimerHandle | None = None


class _Room:
    """An SGLang bootstrap room on the prefill side: where the two workers of a request meet."""

    __slots__ = ("claimed", "handshake", "held", "pull_tokens", "ready")

    def __init__(self) -> None:
        self.handshake = asyncio.Event()  # the decode worker registered
        self.ready = asyncio.Event()  # the prefill finished (held is set) or failed (held is None)
        self.claimed = False  # a prefill request runs in this room
        self.pull_tokens = 0
        self.held: _Held | None = None


class KvTransfers:
    """Both sides of KV transfers for one emulated worker (owned by the app lifespan)."""

    def __init__(self, worker: EmulatedWorker) -> None:
        cfg: EmulatorConfig = worker.cfg
        self.worker = worker
        self.cfg = cfg
        self.engine_id = cfg.kv_engine_id or uuid.uuid4().hex
        wildcard = cfg.host in ("0.0.0.0", "::", "")
        self.host = cfg.kv_advertise_host or ("127.0.0.1" if wildcard else cfg.host)
        self.stats = TransferStats()
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._rooms: dict[int, _Room] = {}
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64)
        )

    async def close(self) -> None:
        await self._client.aclose()
        for transfer_id in list(self._held):
            self._release(transfer_id)

    # ------------------------------------------------------------------ requests

    async def prepare(self, body: Mapping[str, Any], gen: GenerationRequest, param: str) -> Prepared:
        """Act on the request's P/D fields before it is submitted (may wait for a transfer)."""
        pd = parse_pd(body, self.cfg.role)
        if pd is None:
            if self.cfg.role == "decode" and self.cfg.pd_protocol == "sglang":
                raise ApiError.bad_request(
                    "this decode server (SGLang disaggregation) runs only requests whose KV a "
                    "prefill server computes: bootstrap_host, bootstrap_port and bootstrap_room "
                    "are required",
                    "bootstrap_room",
                )
            return Prepared(gen)
        check_single_sequence(gen.n, len(gen.prompts), param)
        if isinstance(pd, RemoteDecode):
            ticket = ProducerTicket()
            return Prepared(gen, on_finish=self._vllm_producer(ticket), ticket=ticket)
        if isinstance(pd, Bootstrap) and self.cfg.role == "prefill":
            room = await self._await_decode(pd.room)
            return Prepared(replace(gen, max_tokens=1), on_finish=self._room_producer(pd.room, room))
        try:
            tokens = await self._receive(gen, pd)
        except TransferFailed as exc:
            self.stats.num_failed += 1
            log.warning("KV transfer failed: %s", exc)
            if self.cfg.kv_load_failure_policy == "recompute":
                return Prepared(gen)
            # vLLM finishes the request with an error and answers its generic message.
            message = (
                "Internal server error" if isinstance(pd, RemotePrefill) else f"KV transfer failed: {exc}"
            )
            return Prepared(gen, failure=ApiError(500, message, "InternalServerError"))
        return Prepared(gen, external_tokens=tokens)

    # ------------------------------------------------------------------ prefill side

    def _hold(self, key: str, live: LiveRequest) -> _Held:
        bs = self.worker.block_size
        hashes = block_hashes(live.prompt_ids, bs, live.salt, self.cfg.seed)
        held = self.worker.engine.hold_blocks(key, hashes)
        prompt = live.num_prompt_tokens
        # Blocks evicted before the hold (a full pool) shorten what can be handed over.
        return _Held(prompt, prompt if held == len(hashes) else held * bs)

    def _vllm_producer(self, ticket: ProducerTicket) -> FinishHook:
        def finished(live: LiveRequest) -> None:
            if live.failed or ticket.group is None:
                return
            if len(self._held) >= MAX_PENDING:
                self._expire(next(iter(self._held)))
            transfer_id = uuid.uuid4().hex
            held = self._hold(transfer_id, live)
            loop = asyncio.get_running_loop()
            held.expiry = loop.call_later(self.cfg.kv_hold_timeout_s, self._expire, transfer_id)
            self._held[transfer_id] = held
            bs = self.worker.block_size
            ticket.group.kv_transfer_params = kv_transfer_params(
                self.engine_id, transfer_id, self.host, self.cfg.port, live.num_prompt_tokens, bs
            )

        return finished

    def pull(self, transfer_id: str, engine_id: str, tokens: int) -> tuple[int, dict[str, Any]]:
        """A decode worker reads a held transfer: (status, body) for the internal route."""
        if engine_id != self.engine_id:
            return 409, _error(409, "remote_engine_id names another engine")
        held = self._held.pop(transfer_id, None)
        if held is None:
            return 404, _error(404, "no KV is held for this remote_request_id (unknown or expired)")
        if held.expiry is not None:
            held.expiry.cancel()
        self._release_after_read(transfer_id, min(tokens, held.num_tokens))
        return 200, self._offer(held)

    def _offer(self, held: _Held) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "num_prompt_tokens": held.num_prompt_tokens,
            "num_tokens": held.num_tokens,
        }

    def _release_after_read(self, key: str, tokens: int) -> None:
        # The blocks stay pinned while the decode side reads them.
        delay = self.worker.profile.kv_transfer_s(max(0, tokens)) / self.cfg.time_scale
        asyncio.get_running_loop().call_later(delay, self.worker.engine.release_hold, key)

    def _expire(self, transfer_id: str) -> None:
        if self._release(transfer_id):
            self.stats.num_expired += 1

    def _release(self, transfer_id: str) -> bool:
        held = self._held.pop(transfer_id, None)
        if held is None:
            return False
        if held.expiry is not None:
            held.expiry.cancel()
        self.worker.engine.release_hold(transfer_id)
        return True

    async def _await_decode(self, room_id: int) -> _Room:
        """SGLang: a prefill request waits for its decode worker to register the room."""
        room = self._rooms.get(room_id)
        if room is None:
            room = self._open_room(room_id)
        if room.claimed:
            raise ApiError.bad_request(f"bootstrap_room {room_id} is already in use", "bootstrap_room")
        room.claimed = True
        timeout_s = self.cfg.kv_bootstrap_timeout_s
        try:
            await asyncio.wait_for(room.handshake.wait(), timeout_s)
        except TimeoutError:
            self._rooms.pop(room_id, None)
            raise ApiError(
                500,
                f"Prefill bootstrap failed for request bootstrap_room={room_id}: "
                f"no decode worker registered within {timeout_s:g} s",
                "InternalServerError",
            ) from None
        return room

    def _open_room(self, room_id: int) -> _Room:
        if len(self._rooms) >= MAX_PENDING:
            raise ApiError.unavailable("too many open bootstrap rooms")
        room = _Room()
        self._rooms[room_id] = room
        return room

    def _room_producer(self, room_id: int, room: _Room) -> FinishHook:
        def finished(live: LiveRequest) -> None:
            key = uuid.uuid4().hex
            if not live.failed:
                room.held = self._hold(key, live)
                self._release_after_read(key, min(room.pull_tokens, room.held.num_tokens))
            room.ready.set()
            self._rooms.pop(room_id, None)  # the waiting decode side holds its own reference

        return finished

    async def serve_bootstrap(
        self, room_id: int, tokens: int, timeout_s: float
    ) -> tuple[int, dict[str, Any]]:
        """A decode worker registers in a room and waits for its prefill: (status, body)."""
        room = self._rooms.get(room_id)
        if room is None:
            room = self._open_room(room_id)
        if room.handshake.is_set():
            return 409, _error(409, f"a decode worker already registered in bootstrap_room {room_id}")
        room.pull_tokens = tokens
        room.handshake.set()
        try:
            await asyncio.wait_for(room.ready.wait(), min(timeout_s, self.cfg.kv_bootstrap_timeout_s))
        except TimeoutError:
            if self._rooms.get(room_id) is room:
                del self._rooms[room_id]
            return 504, _error(504, f"no prefill ran in bootstrap_room {room_id} in time")
        if room.held is None:
            return 410, _error(410, f"the prefill of bootstrap_room {room_id} failed")
        return 200, self._offer(room.held)

    # ------------------------------------------------------------------ decode side

    async def _receive(self, gen: GenerationRequest, source: RemotePrefill | Bootstrap) -> int:
        """Pull the prompt's KV and install it; returns the tokens received. TransferFailed."""
        w = self.worker
        prompt = gen.prompt_ids
        hashes = block_hashes(prompt, w.block_size, gen.cache_salt, self.cfg.seed)
        local = w.engine.prefix_hit_tokens(hashes, len(prompt))
        timeout_s = self.cfg.kv_transfer_timeout_s
        began = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                offer = await fetch(self._client, source, len(prompt) - local, timeout_s)
                if offer.num_prompt_tokens != len(prompt):
                    raise TransferFailed("the prefill worker prefilled another prompt")
                moved = max(0, offer.num_tokens - local)
                transfer_s = w.profile.kv_transfer_s(moved)
                await asyncio.sleep(transfer_s / self.cfg.time_scale)
        except TimeoutError:
            raise TransferFailed(
                f"the KV transfer did not finish within {timeout_s:g} s "
                f"(waited {time.monotonic() - began:.1f} s)"
            ) from None
        installed = w.engine.install_blocks("kv-transfer", hashes[: offer.num_tokens // w.block_size])
        w.publish_installed(installed, prompt, gen.cache_salt)
        self.stats.xfer_time.observe(transfer_s)
        self.stats.bytes_transferred.observe(float(moved * w.profile.kv_bytes_per_token))
        # Blocks that found no room are not cached: the engine then counts only what is.
        return offer.num_tokens


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "KvTransferError", "param": None, "code": status}}
