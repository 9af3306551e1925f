"""The process's lifecycle as the request path sees it: ready, draining, what is in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.disconnect import DisconnectWatch

if TYPE_CHECKING:
    from gateway.streaming import ProxyStream


@dataclass(slots=True)
class Lifecycle:
    """`ready` from lifespan startup to shutdown, `draining` once shutdown begins. The drain
    (`app.drain`) waits on `streams_idle` and ends the streams still in `active_streams` at its
    deadline; `in_flight_requests` counts completions between arrival and their last byte (the
    gateway-wide cap). Invariant: `streams_idle` is set exactly when `active_streams` is empty
    after a stream ended."""

    draining: bool = False
    ready: bool = False
    in_flight_requests: int = 0
    disconnects: DisconnectWatch = field(default_factory=DisconnectWatch)
    active_streams: set[ProxyStream] = field(default_factory=set)
    streams_idle: asyncio.Event = field(default_factory=asyncio.Event)

    def stream_started(self, stream: ProxyStream) -> None:
        self.active_streams.add(stream)
        self.streams_idle.clear()

    def stream_ended(self, stream: ProxyStream) -> None:
        self.active_streams.discard(stream)
        if not self.active_streams:
            self.streams_idle.set()
