"""Clients that never read their answers, against a full connection table: an idle connection
whose answers are still buffered is ended by `send_timeout_s` after its keep-alive deadline
(not held for ever); a connection stalled on an unread answer gives its place to a new one when
no other place is free; and an evicted connection with answers still buffered is aborted, so
that evictions cannot keep closing connections (and their file descriptors) past the table."""

from __future__ import annotations

import dataclasses

from gateway.http_guard import ClientLimits
from tests.gateway.http_limits_rig import GET, LIMITS, RecordingTransport, Rig, rig, settle

__all__ = ["rig"]  # the fixture

ONE_PLACE: ClientLimits = dataclasses.replace(LIMITS, max_connections=1)


async def _answered_unread(rig: Rig) -> RecordingTransport:
    """A connection whose one request was answered, the answer still in its transport's buffer
    (below the high-water mark: the writes never paused)."""
    protocol, transport = rig.connect("127.0.0.2")
    transport.buffered = 4096  # what the client has not read
    protocol.data_received(GET)
    await settle()
    assert transport.status() == 200 and not transport.closed
    return transport


async def test_an_idle_connection_with_unread_answers_ends_at_the_send_timeout(rig: Rig) -> None:
    transport = await _answered_unread(rig)
    protocol = transport.protocol
    rig.guard.tick(protocol.deadline_s + 1.0)  # type: ignore[attr-defined]  # keep-alive deadline
    assert transport.closed and not transport.aborted  # the close waits for the buffer...
    assert set(rig.guard.stalled) == {protocol}
    rig.guard.tick(protocol.send_deadline_s + 1.0)  # type: ignore[attr-defined]
    assert transport.aborted  # ...for `send_timeout_s`, not for ever
    await settle()
    assert not rig.state.connections and not rig.guard.stalled


async def test_an_evicted_connection_with_unread_answers_is_aborted_and_gone(rig: Rig) -> None:
    rig = rig.with_limits(ONE_PLACE)
    transport = await _answered_unread(rig)
    _, newcomer = rig.connect("127.0.0.3")
    assert not newcomer.closed and rig.refusals("evicted") == 1
    assert transport.aborted  # not left closing beside the newcomer
    await settle()
    assert rig.state.connections == {newcomer.protocol} and not rig.guard.stalled


async def test_a_connection_stalled_on_an_unread_answer_gives_its_place(rig: Rig) -> None:
    rig = rig.with_limits(ONE_PLACE)
    protocol, transport = rig.connect("127.0.0.2")
    protocol.pause_writing()  # the client reads nothing: the buffer is past the high-water mark
    protocol.data_received(GET)
    await settle()
    # Its request is in the app, waiting for the buffer to drain: not evictable, but stalled.
    assert set(rig.guard.stalled) == {protocol}
    _, newcomer = rig.connect("127.0.0.3")
    assert not newcomer.closed and transport.aborted
    assert rig.refusals("evicted") == 1 and rig.refusals("connection_limit") == 0
    await settle()
    assert rig.state.connections == {newcomer.protocol} and not rig.guard.stalled
