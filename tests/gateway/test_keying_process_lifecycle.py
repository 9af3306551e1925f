"""The keying process in the request path (`gateway.keying_pool`): other requests are answered
while it keys a large body, a large body is keyed as the loop would key it, a keying process that
dies is replaced (its body keyed in the gateway's own process meanwhile), one that cannot start
is not tried again at once, large bodies wait their turn for it, and the lifespan's end stops
it. The keying process is paused with SIGSTOP where a test needs a body to stay in it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway import keying_pool
from gateway.keying import INLINE_PROMPT_BYTES
from gateway.keying_pool import MAX_JOBS
from tests.gateway.request_rig import Rig, request_rig
from tests.support.wait import wait_until


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    async with request_rig(tiny_model) as built:
        yield built


def _large(tag: str) -> list[dict[str, Any]]:
    """A chat prompt well over the inline size, of many small objects (the costly shape)."""
    parts = [{"type": "text", "text": f"{tag} part {i}"} for i in range(INLINE_PROMPT_BYTES // 20)]
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return False
    return state != "Z"


def _expected_keys(rig: Rig, messages: list[dict[str, Any]]) -> tuple[int, ...]:
    """The keys the gateway's own normalizer gives this prompt (tenant "strict", model "m")."""
    gate = rig.state.gate
    pool = gate.models["m"]
    identity, public = gate.keying.identities(pool, "m", gate.keyring.tenants["strict"])
    body = {"model": "m", "messages": messages}
    return tuple(gate.keying.normalizers[pool.name].canonicalize("chat", body, identity, public).block_keys)


async def _started_keying_process(rig: Rig) -> int:
    """The keying process's id, after one large body has been keyed by it."""
    messages = _large("warm")
    assert (await rig.chat(messages=messages)).status_code == 200
    assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    pid = rig.state.gate.keying.processes.pid()
    assert pid is not None
    return pid


async def test_a_probe_is_answered_while_a_large_body_is_keyed(rig: Rig) -> None:
    keying = rig.state.gate.keying
    pid = await _started_keying_process(rig)
    os.kill(pid, signal.SIGSTOP)  # the next large body stays in the keying process
    try:
        messages = _large("held")
        large = asyncio.create_task(rig.chat(messages=messages))
        await wait_until(lambda: keying.processes.in_flight == 1, what="the large body sent")
        assert (await rig.client.get("/health")).status_code == 200
        small = await rig.chat(messages=[{"role": "user", "content": "a small one meanwhile"}])
        assert small.status_code == 200
        assert not large.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await large).status_code == 200
    assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    assert keying.processes.started == 1


async def test_a_keying_process_that_dies_is_replaced(rig: Rig) -> None:
    keying = rig.state.gate.keying
    pid = await _started_keying_process(rig)
    os.kill(pid, signal.SIGSTOP)
    messages = _large("lost")
    large = asyncio.create_task(rig.chat(messages=messages))
    await wait_until(lambda: keying.processes.in_flight == 1, what="the large body sent")
    os.kill(pid, signal.SIGKILL)
    # Keyed in the gateway's own process instead, with the same keys.
    assert (await large).status_code == 200
    assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    await wait_until(lambda: not _alive(pid), what="the killed keying process reaped")
    messages = _large("next")
    assert (await rig.chat(messages=messages)).status_code == 200
    assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    assert keying.processes.started == 2
    assert keying.processes.pid() not in (None, pid)


async def test_a_large_body_the_normalizer_refuses_is_a_400_naming_the_field(rig: Rig) -> None:
    messages = _large("bad")
    messages[1]["content"].append({"type": "text", "text": 7})
    resp = await rig.chat(messages=messages)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"].startswith("messages[1].content")
    resp = await rig.client.post(
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": ' + b" " * INLINE_PROMPT_BYTES + b"[]}",
        headers={"authorization": "Bearer sk-strict", "content-type": "application/json"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


async def test_the_lifespan_end_stops_the_keying_process(tiny_model: Path) -> None:
    async with request_rig(tiny_model) as rig:
        pid = await _started_keying_process(rig)
        assert _alive(pid)
    await wait_until(lambda: not _alive(pid), what="the keying process stopped")


async def test_an_idle_keying_process_is_stopped_and_the_next_large_body_starts_another(rig: Rig) -> None:
    processes = rig.state.gate.keying.processes
    processes.idle_exit_s = 0.2
    pid = await _started_keying_process(rig)
    await wait_until(lambda: not _alive(pid), what="the idle keying process stopped")
    assert processes.pid() is None
    messages = _large("after")
    assert (await rig.chat(messages=messages)).status_code == 200
    assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    assert processes.started == 2  # a new keying process took it


async def test_small_bodies_never_start_a_keying_process(rig: Rig) -> None:
    for _ in range(3):
        assert (await rig.chat()).status_code == 200
    assert rig.state.gate.keying.processes.started == 0


async def test_large_bodies_wait_their_turn_for_the_keying_process(rig: Rig) -> None:
    keying = rig.state.gate.keying
    pid = await _started_keying_process(rig)
    os.kill(pid, signal.SIGSTOP)
    try:
        prompts = [_large(f"flood {i}") for i in range(2 + MAX_JOBS)]
        flood = [asyncio.create_task(rig.chat(messages=messages)) for messages in prompts]
        await wait_until(
            lambda: keying.processes.in_flight == MAX_JOBS and keying.processes.waiting == 2,
            what="two bodies in the keying process, two waiting",
        )
        assert (await rig.client.get("/health")).status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [r.status_code for r in await asyncio.gather(*flood)] == [200] * len(prompts)
    keyed = {req.block_keys for req in rig.policy.requests[-len(prompts) :]}
    assert keyed == {_expected_keys(rig, messages) for messages in prompts}
    assert keying.processes.in_flight == keying.processes.waiting == 0


def failing_start(parent: int) -> None:
    """A keying process that cannot start (its initializer fails)."""
    raise RuntimeError("no keying process here")


async def test_a_keying_process_that_cannot_start_is_not_retried_at_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keying_pool, "_start_keying_process", failing_start)
    for tag in ("first", "second"):
        messages = _large(tag)
        assert (await rig.chat(messages=messages)).status_code == 200
        assert rig.policy.requests[-1].block_keys == _expected_keys(rig, messages)
    assert rig.state.gate.keying.processes.started == 1  # the second body did not try again
