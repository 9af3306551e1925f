"""KV-cache events in vLLM's wire format over ZMQ (BlockStored / BlockRemoved / AllBlocksCleared).

Each step's changes form one `KVEventBatch`, sent on a PUB socket as three frames:
    [topic (utf-8), sequence (8-byte big-endian, 0, 1, 2, ...), msgpack payload]
payload = [ts_unix_s, [event, ...], data_parallel_rank]. Events are encoded either as
  array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
          lora_name, extra_keys], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]
         (vLLM's msgspec array_like form, trailing defaults omitted), or
  map:   {"type": "BlockStored", "block_hashes": ..., ...} (vLLM after the switch to map encoding).
Hashes are unsigned 64-bit ints. `extra_keys[i]` is `[cache_salt]` for block 0 of a salted
request, else None. A ROUTER socket serves replays: send the first wanted sequence number as 8
bytes big-endian (from a REQ or DEALER), receive `[seq, payload]` for every buffered batch from
there on, then `[-1, b""]`. The last `buffer_steps` batches are kept.

Unlike vLLM, which binds only wildcard endpoints and connects otherwise, the emulator always binds
the given endpoint: subscribers connect to the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.live import KvEventSink, StoredBlocks

log = logging.getLogger("loadtest.emulator.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 100


def encode_stored(ev: StoredBlocks, block_size: int, encoding: str) -> Any:
    extra: list[Any] | None = None
    if ev.cache_salt is not None and ev.first_block_index == 0:
        extra = [[ev.cache_salt]] + [None] * (len(ev.block_hashes) - 1)
    if encoding == "map":
        return {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": extra if extra is not None else [None] * len(ev.block_hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    fields: list[Any] = [
        "BlockStored",
        list(ev.block_hashes),
        ev.parent_block_hash,
        ev.token_ids,
        block_size,
        None,
        "GPU",
        None,
    ]
    if extra is not None:
        fields.append(extra)
    return fields


def encode_removed(hashes: Sequence[int], encoding: str) -> Any:
    if encoding == "map":
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}
    return ["BlockRemoved", list(hashes), "GPU"]


def encode_cleared(encoding: str) -> Any:
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


class ZmqKvEventPublisher(KvEventSink):
    """PUB socket for live events plus an optional ROUTER replay thread (see module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        encoding: str = "array",
        topic: str = "",
        buffer_steps: int = 10000,
        hwm: int = 100000,
    ) -> None:
        if encoding not in ("array", "map"):
            raise ValueError("encoding must be 'array' or 'map'")
        self._encoding = encoding
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()

    def publish(self, stored: Sequence[StoredBlocks], removed: Sequence[int], block_size: int) -> None:
        events: list[Any] = [encode_stored(ev, block_size, self._encoding) for ev in stored]
        if removed:
            events.append(encode_removed(removed, self._encoding))
        if events:
            self._send(events)

    def publish_all_cleared(self) -> None:
        self._send([encode_cleared(self._encoding)])

    def _send(self, events: list[Any]) -> None:
        payload: bytes = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # above the high-water mark: dropped, as vLLM's PUB does; replay covers it
            log.warning("KV event batch %d dropped (high-water mark)", seq)

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(_POLL_MS)):
                    continue
                frames = router.recv_multipart()
                # REQ clients add an empty delimiter frame, DEALER clients do not.
                if len(frames) == 3 and frames[1] == b"":
                    ident, prefix, start_raw = frames[0], [b""], frames[2]
                elif len(frames) == 2:
                    ident, prefix, start_raw = frames[0], [], frames[1]
                else:
                    continue
                if len(start_raw) != 8:
                    router.send_multipart([ident, *prefix, END_OF_REPLAY, b""])
                    continue
                start = int.from_bytes(start_raw, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in batches:
                    router.send_multipart([ident, *prefix, seq.to_bytes(8, "big"), payload])
                router.send_multipart([ident, *prefix, END_OF_REPLAY, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._ctx.term()


def publisher_factory(cfg: EmulatorConfig) -> Callable[[], KvEventSink | None]:
    """A factory the app lifespan calls; returns None when KV events are off."""

    def make() -> KvEventSink | None:
        if cfg.kv_events_endpoint is None:
            return None
        return ZmqKvEventPublisher(
            cfg.kv_events_endpoint,
            cfg.kv_events_replay_endpoint,
            cfg.kv_events_encoding,
            cfg.kv_events_topic,
            cfg.kv_events_buffer_steps,
        )

    return make
