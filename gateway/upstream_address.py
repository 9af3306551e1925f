"""Where the lean upstream client (`gateway.upstream`) connects for a worker, from its URL.

Only a plain-HTTP worker URL without a path is reached directly; anything else (TLS, a path
prefix) stays with aiohttp.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit


@dataclasses.dataclass(frozen=True, slots=True)
class DirectAddress:
    """Where the lean upstream client connects for a plain-HTTP worker (`gateway.upstream`)."""

    host: str
    port: int
    host_header: bytes


def direct_address(url: str) -> DirectAddress | None:
    """The address of an `http://` worker URL without a path; None for anything else (https)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.path not in ("", "/"):
        return None
    try:
        port = parts.port or 80
    except ValueError:
        return None
    return DirectAddress(parts.hostname, port, parts.netloc.encode("idna"))
