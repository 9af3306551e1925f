"""KV events from a real emulator process, decoded by a ZMQ subscriber in the test (vLLM's wire
format: topic / 8-byte sequence / msgpack KVEventBatch), plus the replay socket."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from gateway.kv_events import decode_batch
from loadtest.engine import block_hashes
from policies.base import KvEventKind
from tests.loadtest.test_emulator import MODEL, running_emulator
from tests.support.processes import free_port

pytestmark = pytest.mark.e2e

TOPIC = "kv@emu@" + MODEL


@dataclass
class Decoded:
    """Events in a uniform shape, whatever the wire encoding."""

    kind: str
    hashes: list[int] = field(default_factory=list)
    parent: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    extra_keys: list[Any] | None = None


def decode_event(ev: Any) -> Decoded:
    if isinstance(ev, dict):
        kind = ev["type"]
        if kind == "BlockStored":
            return Decoded(
                kind,
                ev["block_hashes"],
                ev["parent_block_hash"],
                ev["token_ids"],
                ev["block_size"],
                ev["extra_keys"],
            )
        if kind == "BlockRemoved":
            return Decoded(kind, ev["block_hashes"])
        return Decoded(kind)
    kind = ev[0]
    if kind == "BlockStored":
        assert ev[5] is None and ev[6] == "GPU"  # lora_id, medium
        return Decoded(kind, ev[1], ev[2], ev[3], ev[4], ev[8] if len(ev) > 8 else None)
    if kind == "BlockRemoved":
        assert ev[2] == "GPU"
        return Decoded(kind, ev[1])
    return Decoded(kind)


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        self.raw: list[tuple[int, bytes]] = []
        self.events: list[Decoded] = []

    def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Wait for the connection's handshake. PUB/SUB drops what is published before the
        subscription lands (the slow joiner); the subscription is sent right after the handshake,
        ahead of anything the test then asks the emulator to publish."""
        assert self._monitor.poll(int(timeout_s * 1000)), "no handshake with the emulator's PUB socket"
        assert recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        self.sub.disable_monitor()

    def pump(self, until: Any, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"timed out; got {[e.kind for e in self.events]}"
            if self.sub.poll(min(left_ms, 200)):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic.decode() == TOPIC and len(seq) == 8
                self.raw.append((int.from_bytes(seq, "big"), payload))
                ts, events, dp_rank = msgpack.unpackb(payload)
                assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
                self.events.extend(decode_event(e) for e in events)

    def stored(self) -> list[Decoded]:
        return [e for e in self.events if e.kind == "BlockStored"]

    def close(self) -> None:
        self._monitor.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.fixture(params=["array", "map"])
def emulator(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str]]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ("--kv-blocks", "40", "--time-scale", "20", "--kv-events-endpoint", pub,
            "--kv-events-replay-endpoint", replay, "--kv-events-encoding", request.param,
            "--kv-events-topic", TOPIC)  # fmt: skip
    with running_emulator(*args) as base:
        yield base, pub, replay


def complete(base: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_stored_removed_cleared_and_replay(emulator: tuple[str, str, str]) -> None:
    base, pub, replay = emulator
    sub = Subscriber(pub)
    try:
        sub.wait_connected()
        prompt_a = "a" * 100
        complete(base, prompt_a, 4)  # 100 + 3 computed tokens = 6 full blocks
        sub.pump(lambda: sum(len(e.hashes) for e in sub.stored()) >= 6)
        stored = sub.stored()
        hashes_a = [h for e in stored for h in e.hashes]
        answer_ids = list(prompt_a.encode())  # the answer's tokens complete block 6 only at 112
        assert (
            hashes_a == block_hashes(answer_ids, 16)[:6] or hashes_a[:6] == block_hashes(answer_ids, 16)[:6]
        )
        assert stored[0].parent is None and stored[0].block_size == 16
        assert stored[0].token_ids[:16] == list(b"a" * 16)
        for ev in stored:
            assert len(ev.token_ids) == 16 * len(ev.hashes)
        for prev, nxt in itertools.pairwise(stored):
            assert nxt.parent == prev.hashes[-1]

        # A long distinct prompt needs more blocks than are blank: a's blocks are evicted, tail first.
        complete(base, "b" * 600, 1)
        sub.pump(lambda: any(e.kind == "BlockRemoved" for e in sub.events))
        removed = [h for e in sub.events if e.kind == "BlockRemoved" for h in e.hashes]
        assert removed and set(removed) <= set(hashes_a)
        assert removed == hashes_a[::-1][: len(removed)]

        # cache_salt enters block 0's extra keys.
        n_before = len(sub.stored())
        complete(base, "c" * 40, 1, cache_salt="tenant-1")
        sub.pump(lambda: len(sub.stored()) > n_before)
        salted = sub.stored()[n_before]
        assert salted.extra_keys is not None and salted.extra_keys[0] == ["tenant-1"]
        assert salted.hashes[0] == block_hashes(list(b"c" * 40), 16, "tenant-1")[0]
        assert salted.hashes[0] != block_hashes(list(b"c" * 40), 16)[0]

        assert httpx.post(f"{base}/reset_prefix_cache", timeout=5).status_code == 200
        sub.pump(lambda: sub.events[-1].kind == "AllBlocksCleared")
        seqs = [s for s, _ in sub.raw]
        assert seqs == list(range(len(seqs)))

        # Replay from sequence 1 over a DEALER: every buffered batch from there, then -1.
        dealer = sub.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send((1).to_bytes(8, "big"))
        got: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(5000), "replay timed out"
            seq_raw, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_raw, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            got.append((seq, payload))
        dealer.close(linger=0)
        assert got == sub.raw[1:]

        # The gateway's decoder reads every batch the emulator sent, with the same content.
        gateway_events = [ev for _, payload in sub.raw for ev in decode_batch(payload).events]
        assert [ev.kind for ev in gateway_events] == [
            {"BlockStored": KvEventKind.BLOCK_STORED, "BlockRemoved": KvEventKind.BLOCK_REMOVED}.get(
                e.kind, KvEventKind.ALL_BLOCKS_CLEARED
            )
            for e in sub.events
        ]
        first = gateway_events[0]
        assert list(first.block_hashes) == stored[0].hashes and list(first.token_ids) == stored[0].token_ids
    finally:
        sub.close()
