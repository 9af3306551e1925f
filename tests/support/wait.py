"""Waiting for a condition instead of for a time.

A test that sleeps a fixed time and then asserts is either slow (the sleep is long enough for a
loaded machine) or flaky (it is not). These helpers poll a predicate until it returns something
truthy and hand that value back, so the assertion that follows reads what was waited for; only a
predicate that never holds costs the whole timeout, and then the failure names what was awaited.
The timeouts are generous on purpose: they bound a failure, they do not pace a passing test.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0


def wait_until_sync(
    predicate: Callable[[], T],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "",
    interval_s: float = 0.05,
) -> T:
    """Call `predicate` until it returns a truthy value and return that value; raise
    AssertionError naming `what` (or the predicate) after `timeout_s`. For threads and processes:
    it blocks the caller between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {what or _name(predicate)}")
        time.sleep(interval_s)


@overload
async def wait_until(
    predicate: Callable[[], Awaitable[T]],
    timeout_s: float = ...,
    what: str = ...,
    interval_s: float = ...,
) -> T: ...


@overload
async def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = ...,
    what: str = ...,
    interval_s: float = ...,
) -> T: ...


async def wait_until(
    predicate: Callable[[], object],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "",
    interval_s: float = 0.01,
) -> object:
    """`wait_until_sync` for the event loop: the loop keeps running the code under test between
    polls. `predicate` may be a coroutine function (e.g. one HTTP request per poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {what or _name(predicate)}")
        await asyncio.sleep(interval_s)


def _name(predicate: Callable[[], object]) -> str:
    # A lambda's source line says more than "<lambda>".
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))
