"""The active health check: one `GET /health` of a worker, answered 200 or not.

Each pool's round of these (`registry.Pool.check`) feeds `Worker.record_health`, whose streaks
decide when a worker goes up or down; the rounds run on the registry's health tasks, on the
session of the gateway's own checks (`transport.make_probe_session`): the timeout counts the wait
for a pooled connection, which client traffic must not be able to fill.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

# The most of a health answer read (vLLM's is empty): the body is read only so the connection
# can be reused; past this the connection is dropped instead of holding whatever the worker sends.
MAX_HEALTH_ANSWER_BYTES = 64 * 1024


async def probe_health(
    url: str, timeout_s: float, session: aiohttp.ClientSession, headers: Mapping[str, str]
) -> bool:
    """Whether the worker answers `/health` with 200. Its body is never kept: at most
    `MAX_HEALTH_ANSWER_BYTES` are read (and dropped); a longer one closes the connection, and
    the status alone decides."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url + "/health", timeout=timeout, headers=headers) as resp:
            read = 0
            while chunk := await resp.content.readany():
                read += len(chunk)
                if read > MAX_HEALTH_ANSWER_BYTES:
                    resp.close()
                    break
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
