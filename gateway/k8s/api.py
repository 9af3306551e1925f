"""The API server's list and watch of Pods, spoken over aiohttp with every buffer bounded.

List: `GET /api/v1/namespaces/NS/pods?labelSelector=S&limit=N[&continue=T]`, a `PodList` whose
`metadata.resourceVersion` is the version of the snapshot; with `resourceVersion=RV` and
`resourceVersionMatch=NotOlderThan` on its first page, any snapshot at least as new as RV will do.
Watch: the same path with `watch=1`, `resourceVersion=RV`, `allowWatchBookmarks=true` and
`timeoutSeconds`, answered by a stream of newline-delimited
`{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": {...}}`. An ERROR event carries a
`Status`; code 410 (or an HTTP 410) means the version is no longer served and the caller must list
again (`Expired`). A 429 carries `Retry-After` (and the Status its `details.retryAfterSeconds`).

Credentials: in a pod, `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT` with the
service account's token and CA under `/var/run/secrets/kubernetes.io/serviceaccount`. The kubelet
rotates that token, so it is re-read every minute and after any 401. Files are read in a thread.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.k8s.config import KubernetesDiscoveryConfig

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_MAX_ERROR_BODY_BYTES = 64 * 1024
_PARSE_IN_THREAD_BYTES = 1024 * 1024  # bigger list pages are parsed off the event loop
# A list page: parsed, its JSON takes about 8-9 times its size in Python objects (a page of 250
# pods of 8.8 kB each, 2.2 MB of JSON, takes 17.7 MB), so a page at the cap is about 80 MB while it
# is read, per pool and per process. Realistic pods (9-17 kB) fill 250 a page to 2-4 MB; the
# watcher asks for fewer pods a page, down to one, when a page is too large.
PAGE_PODS = 250
MAX_PAGE_BYTES = 8 * 1024 * 1024
# The longest a watch may say nothing before its link is taken for dead (one whose far end vanished
# without a reset). The API server's watch cache sends a bookmark about every minute to a watch
# that allows them, and another just before timeoutSeconds; so even a quiet watch is never silent
# for much longer than a minute while the link is alive.
WATCH_SILENCE_S = 90.0


class KubernetesSetupError(Exception):
    """Discovery cannot start: no API server address, token, CA or namespace. Waiting won't help."""


class ApiError(Exception):
    """The API server answered with an error status (HTTP, or an ERROR event's Status)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s  # Retry-After, or the Status's details.retryAfterSeconds


class Expired(ApiError):
    """410: the resource version asked for is too old; list again."""


class ProtocolError(Exception):
    """A response that is not what the protocol promises, or larger than allowed."""


class TooLarge(ProtocolError):
    """A response body larger than allowed (a list page: ask for fewer pods a page)."""


@dataclass(frozen=True, slots=True)
class Access:
    """Where the API server is and how to authenticate, resolved once at start."""

    base_url: str
    namespace: str
    token_file: Path | None
    ssl_context: ssl.SSLContext | None  # None: the default trust store (or plain http)


def _read_text(path: Path, what: str, field: str) -> str:
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise KubernetesSetupError(
            f"cannot read the {what} {str(path)!r} ({field}): {exc.strerror}"
        ) from None
    if not value:
        raise KubernetesSetupError(f"the {what} {str(path)!r} ({field}) is empty")
    return value


def _ssl_context(ca_file: Path) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as exc:
        raise KubernetesSetupError(f"cannot load the CA bundle {str(ca_file)!r} (ca_file): {exc}") from None


def _resolve(config: KubernetesDiscoveryConfig, environ: Mapping[str, str], sa_dir: Path) -> Access:
    if config.api_server is not None:
        base_url = config.api_server
        token = Path(config.token_file) if config.token_file else None
        ca = Path(config.ca_file) if config.ca_file else None
    else:
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubernetesSetupError(
                "KUBERNETES_SERVICE_HOST/PORT are not set (not running in a pod): set "
                "kubernetes.api_server to reach an API server from outside the cluster"
            )
        base_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        token = Path(config.token_file) if config.token_file else sa_dir / "token"
        ca = Path(config.ca_file) if config.ca_file else sa_dir / "ca.crt"
    namespace = config.namespace or _read_text(
        sa_dir / "namespace", "service-account namespace file", "kubernetes.namespace"
    )
    if token is not None:
        _read_text(token, "token file", "kubernetes.token_file")
    context = _ssl_context(ca) if ca is not None and base_url.startswith("https://") else None
    return Access(base_url, namespace, token, context)


def check_access(
    config: KubernetesDiscoveryConfig,
    environ: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> None:
    """What `resolve_access` checks, at once (`kvgate serve` before it starts serving: a pool that
    cannot reach its API server stops the start with the reason, not a traceback from the
    lifespan); raises `KubernetesSetupError`."""
    _resolve(config, dict(os.environ) if environ is None else environ, sa_dir)


async def resolve_access(
    config: KubernetesDiscoveryConfig,
    environ: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> Access:
    """Find the API server and check the credentials are readable (raises `KubernetesSetupError`)."""
    env = dict(os.environ) if environ is None else environ
    return await asyncio.to_thread(_resolve, config, env, sa_dir)


class Token:
    """The bearer token, re-read from its file when older than `max_age_s` or after a 401."""

    def __init__(self, path: Path | None, max_age_s: float = 60.0) -> None:
        self._path = path
        self._max_age_s = max_age_s
        self._value = ""
        self._read_at_s = -float("inf")

    def invalidate(self) -> None:
        self._read_at_s = -float("inf")

    async def headers(self) -> dict[str, str]:
        if self._path is None:
            return {}
        if time.monotonic() - self._read_at_s > self._max_age_s:
            self._value = await asyncio.to_thread(
                _read_text, self._path, "token file", "kubernetes.token_file"
            )
            self._read_at_s = time.monotonic()
        return {"Authorization": f"Bearer {self._value}"}


@dataclass(frozen=True, slots=True)
class PodPage:
    """One page of a pod list."""

    items: list[Mapping[str, Any]]
    resource_version: str
    continue_token: str | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One line of a watch stream (never ERROR: those are raised)."""

    type: str
    object: Mapping[str, Any]


_WATCH_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})


class PodApi:
    """List and watch the pods of one namespace and selector through one aiohttp session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        access: Access,
        token: Token,
        selector: str,
        *,
        page_size: int = PAGE_PODS,
        max_page_bytes: int = MAX_PAGE_BYTES,
        max_event_bytes: int = 4 * 1024 * 1024,
        request_timeout_s: float = 30.0,
        watch_timeout_s: int = 300,
        watch_silence_s: float = WATCH_SILENCE_S,
    ) -> None:
        self._session = session
        self._url = f"{access.base_url}/api/v1/namespaces/{access.namespace}/pods"
        self._token = token
        self._selector = selector
        self._page_size = page_size
        self._max_page_bytes = max_page_bytes
        self._max_event_bytes = max_event_bytes
        self._list_timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._watch_timeout_s = watch_timeout_s
        self._watch_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=request_timeout_s, sock_read=min(watch_timeout_s + 30, watch_silence_s)
        )

    async def list_page(
        self, continue_token: str | None = None, not_older_than: str | None = None, limit: int | None = None
    ) -> PodPage:
        """One page of at most `limit` pods (else `page_size`): the first (no `continue_token`) of
        a snapshot at least as new as `not_older_than` when given, else the latest; or the next
        one of the same snapshot. Raises `TooLarge` for a page over `max_page_bytes`."""
        params = {"labelSelector": self._selector, "limit": str(limit or self._page_size)}
        if continue_token:
            params["continue"] = continue_token
        elif not_older_than:
            params["resourceVersion"] = not_older_than
            params["resourceVersionMatch"] = "NotOlderThan"
        async with self._session.get(
            self._url, params=params, headers=await self._headers(), timeout=self._list_timeout
        ) as resp:
            await self._check(resp)
            body = await _read_bounded(resp, self._max_page_bytes)
        doc = await asyncio.to_thread(_loads, body) if len(body) > _PARSE_IN_THREAD_BYTES else _loads(body)
        items = doc.get("items") or []  # an empty list may come as null
        meta = doc.get("metadata")
        if not isinstance(items, list) or not isinstance(meta, dict):
            raise ProtocolError("a pod list without items or metadata")
        rv = meta.get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            raise ProtocolError("a pod list without metadata.resourceVersion")
        token = meta.get("continue")
        return PodPage(
            [i for i in items if isinstance(i, dict)], rv, token if isinstance(token, str) and token else None
        )

    async def watch(self, resource_version: str) -> AsyncGenerator[WatchEvent, None]:
        """Events after `resource_version` until the server ends the stream; raises on ERROR."""
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        async with self._session.get(
            self._url, params=params, headers=await self._headers(), timeout=self._watch_timeout
        ) as resp:
            await self._check(resp)
            async for line in _lines(resp, self._max_event_bytes):
                yield _event(_loads(line))

    async def _headers(self) -> dict[str, str]:
        return {"Accept": "application/json", "User-Agent": "kvgate", **await self._token.headers()}

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 300:
            return
        if resp.status == 401:
            self._token.invalidate()  # rotated under us: read it again before the next request
        try:
            doc = _loads(await _read_bounded(resp, _MAX_ERROR_BODY_BYTES))
        except ProtocolError:
            doc = {}
        raise _status_error(resp.status, doc, _seconds(resp.headers.get("Retry-After")))


# A Retry-After of more digits than this is taken as this long (the watcher caps its wait anyway).
_RETRY_AFTER_DIGITS = 10
_RETRY_AFTER_MAX_S = 10**_RETRY_AFTER_DIGITS - 1


def _loads(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"invalid JSON from the API server: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("the API server sent JSON that is not an object")
    return doc


def _status_error(code: int, status: Mapping[str, Any], retry_after_s: float | None = None) -> ApiError:
    reason = status.get("reason")
    message = status.get("message")
    if retry_after_s is None:
        details = status.get("details")
        if isinstance(details, dict):
            retry_after_s = _seconds(details.get("retryAfterSeconds"))
    cls = Expired if code == 410 else ApiError
    return cls(
        code,
        reason if isinstance(reason, str) else "",
        message if isinstance(message, str) else "",
        retry_after_s,
    )


def _seconds(value: object) -> float | None:
    """A Retry-After in seconds (the API server never sends the HTTP-date form), else None. Only
    ASCII digits count (`str.isdigit` takes "²"), and never more than `_RETRY_AFTER_DIGITS` of
    them: a longer number is no longer wait than the watcher's cap, and `int` / `float` of it
    would raise. Never raises."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if value < 0:
            return None
        return float(min(value, _RETRY_AFTER_MAX_S))
    if not isinstance(value, str):
        return None
    digits = value.strip()
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    digits = digits.lstrip("0") or "0"  # `00005` is 5 s, not a number too long to read
    if len(digits) > _RETRY_AFTER_DIGITS:
        return float(_RETRY_AFTER_MAX_S)
    return float(int(digits))


def _event(doc: Mapping[str, Any]) -> WatchEvent:
    kind, obj = doc.get("type"), doc.get("object")
    if not isinstance(obj, dict):
        raise ProtocolError("a watch event without an object")
    if kind == "ERROR":
        code = obj.get("code")
        raise _status_error(code if isinstance(code, int) else 500, obj)
    if kind not in _WATCH_TYPES:
        raise ProtocolError(f"unknown watch event type {str(kind)[:40]!r}")
    return WatchEvent(str(kind), obj)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise TooLarge(f"a response of {resp.content_length} bytes (limit {limit})")
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise TooLarge(f"a response larger than {limit} bytes")
    return bytes(buf)


async def _lines(resp: aiohttp.ClientResponse, limit: int) -> AsyncIterator[bytes]:
    """The stream's non-empty lines; a line longer than `limit` is an error, not a bigger buffer."""
    buf = bytearray()
    scanned = 0  # bytes of `buf` known to hold no newline
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n", scanned)) >= 0:
            line = bytes(buf[:end]).strip()
            del buf[: end + 1]
            scanned = 0
            if line:
                yield line
        scanned = len(buf)
        if scanned > limit:
            raise ProtocolError(f"a watch event longer than {limit} bytes")
    if buf.strip():
        yield bytes(buf).strip()
