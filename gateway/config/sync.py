"""The `sync` block of the gateway config: replica sync through a NATS broker (docs/sync.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.config.base import Frozen, PositiveFloat, PositiveInt


class SyncConfig(Frozen):
    """Replica sync (docs/sync.md): gateways sharing one worker fleet publish their routing decisions
    and in-flight load through a NATS broker and apply each other's. Off unless `url` is set.

    The broker is never on a request's path: items wait in a queue of `queue_max_items` (the
    oldest is dropped and counted when it is full) and go out in batches of up to
    `batch_max_items`, `batch_interval_s` after the first of them. Every `load_refresh_s` the
    whole in-flight load goes out even if unchanged; a peer silent for `peer_timeout_s` is
    forgotten with its load. With `share_calibration` each completion's calibration sample is
    published too and peers fold it into their cost model, so that every gateway calibrates from
    all of the fleet's completions; off (the default: gateways that calibrate alike also choose
    alike for requests that arrive together, see docs/sync.md), a gateway neither publishes nor
    applies them and calibrates from its own."""

    url: str | None = Field(default=None, pattern=r"^(nats|tls)://")
    subject_prefix: str = Field(default="kvgate.sync", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
    batch_max_items: PositiveInt = 256
    batch_interval_s: PositiveFloat = 0.005
    queue_max_items: PositiveInt = 16_384
    load_refresh_s: PositiveFloat = 1.0
    peer_timeout_s: PositiveFloat = 5.0
    connect_timeout_s: PositiveFloat = 2.0
    share_calibration: bool = False

    @model_validator(mode="after")
    def _timeouts(self) -> SyncConfig:
        if self.peer_timeout_s <= self.load_refresh_s:
            raise ValueError("peer_timeout_s must be longer than load_refresh_s")
        return self
