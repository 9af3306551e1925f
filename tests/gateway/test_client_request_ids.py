"""The id a worker is told for a request (`request_head.upstream_request_id`): the client's own,
as vLLM reads it (the `X-Request-Id` header, else the body's `request_id`), when it is safe in a
header line and a log line; else the gateway's internal id, which names the request everywhere
else in the gateway."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.request_head import MAX_CLIENT_ID_CHARS, RequestIds, upstream_request_id

INTERNAL = "0" * 24


def ids(client: str | None = None) -> RequestIds:
    return RequestIds(INTERNAL, client)


@pytest.mark.parametrize(
    ("client", "body", "sent"),
    [
        ("from-header", {"request_id": "from-body"}, "from-header"),  # the header first, as vLLM
        (None, {"request_id": "from-body"}, "from-body"),
        (None, {}, INTERNAL),
        (None, {"request_id": 7}, INTERNAL),
        (None, {"request_id": ""}, INTERNAL),
        (None, {"request_id": "a\r\nx-injected: 1"}, INTERNAL),  # would split a header line
        (None, {"request_id": "café"}, INTERNAL),  # not ASCII: not a header value everywhere
        (None, {"request_id": " padded "}, INTERNAL),  # a header parser would strip the spaces
        (None, {"request_id": "x" * (MAX_CLIENT_ID_CHARS + 1)}, INTERNAL),
        (None, {"request_id": "x" * MAX_CLIENT_ID_CHARS}, "x" * MAX_CLIENT_ID_CHARS),
        (None, {"request_id": "req 1/a:b"}, "req 1/a:b"),
    ],
)
def test_the_header_then_the_bodys_id_if_sane_else_the_gateways(
    client: str | None, body: dict[str, Any], sent: str
) -> None:
    assert upstream_request_id(ids(client), body) == sent
