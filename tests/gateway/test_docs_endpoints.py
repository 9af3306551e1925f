"""docs/gateway.md lists exactly the `endpoint` values the gateway can emit."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.responses_routes import STORED_RESPONSE_ENDPOINTS
from gateway.routes import ROUTES

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def test_the_documented_endpoint_labels_are_the_route_tables() -> None:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `kvgate_requests_total`"))
    listed = re.search(r"`endpoint` \(([^;]*?):", row)
    assert listed is not None, row
    documented = re.findall(r"`([a-z_.]+)`", listed.group(1))
    emitted = list(dict.fromkeys(route.endpoint for route in ROUTES.values()))
    assert documented == [*emitted, *STORED_RESPONSE_ENDPOINTS]
