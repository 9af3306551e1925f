"""The gateway's access log, its lines kept for a test instead of written to stderr."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.logs import AccessLog
from gateway.state import GatewayState


class AccessLines(AccessLog):
    """Every line as the gateway serialized it (`AccessLog.write`), parsed back."""

    def __init__(self) -> None:
        super().__init__(fd=-1)
        self.records: list[dict[str, Any]] = []

    def flush(self) -> None:
        self.records += [orjson.loads(line) for line in self._lines]
        self._lines.clear()

    def of(self, request_id: str) -> dict[str, Any]:
        """The one line of the request the client knows as `request_id` (its `x-request-id`)."""
        self.flush()
        (line,) = (r for r in self.records if request_id in (r["request_id"], r["client_request_id"]))
        return line


def capture_access(state: GatewayState) -> AccessLines:
    lines = AccessLines()
    state.routing.access_log = lines
    return lines
