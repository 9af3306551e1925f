"""Keying work handed out fairly across tenants (`gateway.keying_pool.FairSlots`): the keying
process's places for large bodies and the keying thread's for tokenizer mode. A tenant's one
request waits for about one more of a busy tenant's, not for the whole burst; a request that
leaves gives its place back, but only once the work it started has ended.

The keying process and thread are replaced by `HeldExecutor`, which runs a job only when the test
says: the order in which jobs are handed to it is the order the tenants are served in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.keying import INLINE_PROMPT_BYTES, THREAD_JOBS, Keying
from gateway.keying_pool import MAX_JOBS, FairSlots, run_fairly
from gateway.large_body import BodyJob
from tests.gateway.request_rig import Rig, request_rig
from tests.support.wait import wait_until


class HeldExecutor(concurrent.futures.Executor):
    """Takes jobs and runs each only when `finish_next` is called, oldest first. A job counts as
    started when it is taken (it can no longer be cancelled), as in the keying process, whose
    queue takes both of its jobs at once."""

    def __init__(self) -> None:
        self.taken: list[functools.partial[Any]] = []  # every job handed over, in order
        self._pending: list[tuple[concurrent.futures.Future[Any], functools.partial[Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        job = functools.partial(fn, *args, **kwargs)
        self.taken.append(job)
        self._pending.append((future, job))
        return future

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finish_next(self) -> None:
        future, job = self._pending.pop(0)
        future.set_result(job())


@pytest.fixture
async def rig(tiny_model: Path) -> AsyncIterator[Rig]:
    async with request_rig(tiny_model) as built:
        yield built


def _large(tag: str) -> list[dict[str, Any]]:
    """A chat prompt over the inline size, its parts naming `tag`."""
    parts = [{"type": "text", "text": f"{tag} part {i}"} for i in range(INLINE_PROMPT_BYTES // 20)]
    return [{"role": "user", "content": parts}]


async def _served_order(
    held: HeldExecutor, waiting: Callable[[], int], sender: Callable[[functools.partial[Any]], str]
) -> list[str]:
    """Run the held jobs one at a time, each time waiting until a waiter got the place it freed;
    the sender of each job, in the order the jobs were handed over."""
    while held.pending:
        before = len(held.taken)
        still_waiting = waiting()
        held.finish_next()
        if still_waiting:
            await wait_until(
                lambda before=before: len(held.taken) > before,
                what="the freed place handed to a waiter",
            )
    return [sender(job) for job in held.taken]


async def test_a_tenants_one_large_body_is_keyed_after_about_one_of_a_busy_tenants(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    processes = rig.state.gate.keying.processes
    held = HeldExecutor()
    monkeypatch.setattr(processes, "_pool", lambda: held)
    burst = [asyncio.create_task(rig.chat("sk-strict", messages=_large(f"busy {i}"))) for i in range(6)]
    await wait_until(
        lambda: held.pending == MAX_JOBS and processes.waiting == 4, what="the burst in and waiting"
    )
    lone = asyncio.create_task(rig.chat("sk-shared", messages=_large("lone")))
    await wait_until(lambda: processes.waiting == 5, what="the other tenant's body waiting")

    def sender(job: functools.partial[Any]) -> str:
        body_job = job.args[0]
        assert isinstance(body_job, BodyJob)
        return "B" if b'"lone part 0"' in body_job.raw else "A"

    order = await _served_order(held, lambda: processes.waiting, sender)
    # In first come, first served order B would be last, after all six.
    assert order == ["A", "A", "A", "B", "A", "A", "A"]
    assert [r.status_code for r in await asyncio.gather(*burst, lone)] == [200] * 7
    assert processes.in_flight == processes.waiting == 0
    processes.slots.check_invariants()


async def test_a_tenants_one_tokenizer_request_is_canonicalized_after_about_one_of_a_busy_tenants(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    keying = rig.state.gate.keying
    held = HeldExecutor()
    monkeypatch.setattr(Keying, "executor", lambda self: held)

    def chat(key: str, text: str) -> asyncio.Task[Any]:
        return asyncio.create_task(rig.chat(key, model="m-tok", messages=[{"role": "user", "content": text}]))

    burst = [chat("sk-strict", f"busy {i}") for i in range(6)]
    await wait_until(
        lambda: held.pending == THREAD_JOBS and keying.thread_slots.waiting == 4,
        what="the burst in and waiting",
    )
    lone = chat("sk-shared", "lone")
    await wait_until(lambda: keying.thread_slots.waiting == 5, what="the other tenant's request waiting")

    def sender(job: functools.partial[Any]) -> str:
        body = job.args[1]  # canonicalize(prompt, body, identity, public)
        return "B" if body["messages"][0]["content"] == "lone" else "A"

    order = await _served_order(held, lambda: keying.thread_slots.waiting, sender)
    assert order == ["A", "A", "A", "B", "A", "A", "A"]
    assert [r.status_code for r in await asyncio.gather(*burst, lone)] == [200] * 7
    keying.thread_slots.check_invariants()


async def test_tenants_take_turns_and_a_newcomer_never_takes_a_freed_slot_first() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")  # free: taken at once
    served: list[str] = []

    async def use(tenant: str, tag: str) -> None:
        await slots.acquire(tenant)
        served.append(tag)

    waiters = [asyncio.create_task(use("a", f"a{i}")) for i in range(3)]
    waiters += [asyncio.create_task(use("b", f"b{i}")) for i in range(2)]
    waiters.append(asyncio.create_task(use("c", "c0")))
    await wait_until(lambda: slots.waiting == 6, what="six waiting")
    for n in range(1, 7):
        slots.release()
        assert slots.free == 0  # handed on, not given to whoever asks next
        await wait_until(lambda n=n: len(served) == n, what=f"{n} served")
        slots.check_invariants()
    assert served == ["a0", "b0", "c0", "a1", "b1", "a2"]
    slots.release()
    assert slots.free == 1 and slots.waiting == 0
    await asyncio.gather(*waiters)


async def test_a_waiter_that_leaves_gives_its_turn_to_the_next() -> None:
    slots = FairSlots(1)
    await slots.acquire("a")
    gone = asyncio.create_task(slots.acquire("b"))
    nxt = asyncio.create_task(slots.acquire("c"))
    await wait_until(lambda: slots.waiting == 2, what="two waiting")
    gone.cancel()  # before its turn: it leaves the order
    await asyncio.gather(gone, return_exceptions=True)
    assert slots.waiting == 1
    slots.release()
    await nxt
    assert slots.free == 0 and slots.waiting == 0

    late = asyncio.create_task(slots.acquire("b"))
    after = asyncio.create_task(slots.acquire("c"))
    await wait_until(lambda: slots.waiting == 2, what="two waiting")
    slots.release()  # handed to `late`, which is cancelled before it runs: `after` gets it
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    await after
    assert slots.free == 0 and slots.waiting == 0
    slots.check_invariants()


async def test_a_place_is_given_back_only_when_the_work_of_a_request_that_left_has_ended() -> None:
    """A thread (or the keying process) finishes a job whose caller was cancelled: until it has,
    that job still takes its place, so what is queued for it stays bounded."""
    slots = FairSlots(1)
    held = HeldExecutor()
    left = asyncio.create_task(run_fairly(slots, "a", held, lambda: "a"))
    await wait_until(lambda: held.pending == 1, what="the job handed over")
    nxt = asyncio.create_task(run_fairly(slots, "b", held, lambda: "b"))
    await wait_until(lambda: slots.waiting == 1, what="the next one waiting")
    left.cancel()
    await asyncio.gather(left, return_exceptions=True)
    assert slots.waiting == 1 and len(held.taken) == 1  # the held job still takes the place
    held.finish_next()
    await wait_until(lambda: held.pending == 1, what="the place handed on once the job ended")
    held.finish_next()
    assert await nxt == "b"
    assert slots.free == 1


async def test_a_body_whose_request_left_holds_its_place_in_the_keying_process(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    processes = rig.state.gate.keying.processes
    held = HeldExecutor()
    monkeypatch.setattr(processes, "_pool", lambda: held)
    first = [
        asyncio.create_task(rig.chat("sk-strict", messages=_large(f"left {i}"))) for i in range(MAX_JOBS)
    ]
    await wait_until(lambda: held.pending == MAX_JOBS, what="the keying process full")
    queued = asyncio.create_task(rig.chat("sk-shared", messages=_large("queued")))
    await wait_until(lambda: processes.waiting == 1, what="a body waiting")
    for task in first:
        task.cancel()
    await asyncio.gather(*first, return_exceptions=True)
    assert processes.in_flight == MAX_JOBS and processes.waiting == 1 and len(held.taken) == MAX_JOBS
    held.finish_next()
    await wait_until(lambda: len(held.taken) == MAX_JOBS + 1, what="the place handed on")
    while held.pending:
        held.finish_next()
    assert (await queued).status_code == 200
    await wait_until(lambda: processes.in_flight == 0, what="every place given back")
