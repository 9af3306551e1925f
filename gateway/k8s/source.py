"""The ready pods of one label selector, kept current by list + watch and published to discovery.

    prepare:  find the API server, check token / CA / namespace (errors here stop the start)
    loop:     list all pages -> snapshot -> publish
                  (a page over max_page_bytes: asked for again with half as many pods)
              watch from the list's resourceVersion; each event updates the snapshot -> publish
              stream ended by the server's timeout -> watch again from the last version seen
              connection dropped or refused / timeout / 429 / 5xx (HTTP or ERROR event)
                  -> record, back off (at least a 429's Retry-After, up to backoff_max_s),
                     watch again from the last version seen: nothing was lost
              410 / any other error / bad data / MAX_WATCH_RETRIES such retries in a row
                  -> record, back off, list again

A list after a watch asks for a snapshot no older than the last version seen
(`resourceVersionMatch=NotOlderThan`), which the API server may serve from its watch cache rather
than from etcd; a list that fails so is retried from the latest. This is how client-go's reflector
treats its watch errors.

Only routable pods are kept (URL and details, never the Pod object). The first `max_pods` of them
in the order they became routable are routed; up to as many more wait, in that order, and each
takes the place of a routed pod that leaves (a rollout's surge is briefly more than it replaces);
any beyond those are ignored until the next list. A list keeps the order of the pods it knew.

The backoff doubles from `backoff_initial_s` up to `backoff_max_s` and resets only once a watch
delivers an event, so a server that fails right after every list is not hammered.

Readiness waits for the first list (`Discovery.settled`) through errors that waiting may fix, but
not for good: an error waiting will not fix (`LASTING`, an unverified certificate) ends the wait at
once, and any error does once `first_list_wait_s` (`FIRST_LIST_WAIT_S`) has passed since the start
without a list. The pool is then empty until a list arrives; the watcher keeps trying.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from gateway.discovery import WorkerDetails, WorkerSink
from gateway.k8s.api import (
    MAX_PAGE_BYTES,
    PAGE_PODS,
    SERVICE_ACCOUNT_DIR,
    WATCH_SILENCE_S,
    Access,
    ApiError,
    Expired,
    KubernetesSetupError,
    PodApi,
    ProtocolError,
    Token,
    TooLarge,
    resolve_access,
)
from gateway.k8s.config import KubernetesDiscoveryConfig
from gateway.k8s.pods import PodEndpoint, PodSettings, pod_name, read_pod, resource_version

log = logging.getLogger("kvgate.k8s")

# Answers that waiting is not expected to fix (a token the API server refuses, a Role that may not
# list pods, a wrong api_server path; and, outside HTTP, a certificate the CA does not verify):
# readiness stops waiting for the first list on them, so that one pool's RBAC mistake does not
# keep the gateway from serving every other pool. The watcher still retries, and the pool fills up
# once the mistake is fixed.
LASTING = frozenset({401, 403, 404})
# How long readiness waits for the first list through errors that waiting may fix (the API server
# unreachable, 5xx, an answer that is not the Kubernetes API): after it every error is taken as
# lasting. Long enough for an API server that restarts, short enough for a rollout not to stall.
FIRST_LIST_WAIT_S = 60.0
# Failed watches in a row (none delivering an event) retried from the last version before a list.
MAX_WATCH_RETRIES = 5


class Backoff:
    """Exponential delays with jitter (each in [d/2, d]), capped."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s, self._max_s = initial_s, max_s
        self._next_s = initial_s

    def reset(self) -> None:
        self._next_s = self._initial_s

    def next(self) -> float:
        delay = self._next_s
        self._next_s = min(self._max_s, self._next_s * 2)
        return random.uniform(delay / 2, delay)


class PodWatcher:
    """A `WatchingSource` for `gateway.discovery.Discovery`: one namespace, one selector."""

    def __init__(
        self,
        config: KubernetesDiscoveryConfig,
        *,
        environ: Mapping[str, str] | None = None,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        page_size: int = PAGE_PODS,
        max_page_bytes: int = MAX_PAGE_BYTES,
        max_event_bytes: int = 4 * 1024 * 1024,
        request_timeout_s: float = 30.0,
        watch_silence_s: float = WATCH_SILENCE_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        first_list_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._environ = environ
        self._sa_dir = sa_dir
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._clock = clock
        self._first_list_wait_s = FIRST_LIST_WAIT_S if first_list_wait_s is None else first_list_wait_s
        self._started_s = 0.0  # when `run` began: the first list is overdue `first_list_wait_s` later
        self._gave_up_waiting = False
        self._page_size = page_size  # halved for good after a page over max_page_bytes
        self._max_page_bytes = max_page_bytes
        self._max_event_bytes = max_event_bytes
        self._request_timeout_s = request_timeout_s
        self._watch_silence_s = watch_silence_s
        self._settings = PodSettings(
            port=config.port,
            scheme=config.scheme,
            kv_events_port=config.kv_events_port,
            kv_events_annotation=config.kv_events_annotation,
            role_label=config.role_label,
        )
        self._access: Access | None = None
        # Routable pods by name, in the order they became routable: the first `max_pods` are routed.
        self._pods: dict[str, PodEndpoint] = {}
        self._warned: dict[str, str] = {}  # pod name -> the problem last logged for it
        self._version: str | None = None  # the last version seen; None: list next
        self._list_from: str | None = None  # the next list is no older than this version
        self._watch_failures = 0  # failed watches retried in a row, since the last event
        self.lists = 0  # full lists done (the first one and every resync)

    async def prepare(self) -> None:
        self._access = await resolve_access(self._config, self._environ, self._sa_dir)
        log.info(
            "following pods %r in namespace %s through %s",
            self._config.selector,
            self._access.namespace,
            self._access.base_url,
        )

    async def run(self, sink: WorkerSink) -> None:
        if self._access is None:
            await self.prepare()
        assert self._access is not None
        self._started_s = self._clock()
        while True:
            await self._follow_on_a_session(sink)
            # The API server's certificate failed verification: read the CA bundle again, so that a
            # fixed `ca.crt` (a mounted Secret updated in place) is taken without a restart.
            try:
                self._access = await resolve_access(self._config, self._environ, self._sa_dir)
            except KubernetesSetupError as exc:
                sink.record_error("list", f"{type(exc).__name__}: {exc}", lasting=True)

    async def _follow_on_a_session(self, sink: WorkerSink) -> None:
        """Follow the pods on one connection pool, built with the CA bundle as last read, until
        the API server's certificate fails verification."""
        assert self._access is not None
        connector = aiohttp.TCPConnector(limit=2, ssl=self._access.ssl_context or True)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:
            api = PodApi(
                session,
                self._access,
                Token(self._access.token_file),
                self._config.selector,
                page_size=self._page_size,
                max_page_bytes=self._max_page_bytes,
                max_event_bytes=self._max_event_bytes,
                request_timeout_s=self._request_timeout_s,
                watch_timeout_s=self._config.watch_timeout_s,
                watch_silence_s=self._watch_silence_s,
            )
            await self._follow(api, sink)

    async def _follow(self, api: PodApi, sink: WorkerSink) -> None:
        """List and watch until the API server's certificate fails verification (then return:
        the caller reads the CA bundle again)."""
        while True:
            stage = "list" if self._version is None else "watch"
            retry_after_s: float | None = None
            lasting = untrusted = False
            try:
                if self._version is None:
                    if self.lists:
                        sink.record_resync()
                    self._version = await self._list(api, sink)
                    stage = "watch"
                while True:
                    await self._watch(api, sink)
            except Expired as exc:
                reason, error = "expired", str(exc)
                self._after_failure(stage, retriable=False)
            except ApiError as exc:
                retry_after_s = exc.retry_after_s
                reason, error, lasting = stage, f"{type(exc).__name__}: {exc}", exc.status in LASTING
                self._after_failure(stage, retriable=exc.status == 429 or exc.status >= 500)
            except (
                KubernetesSetupError,  # e.g. the token file briefly missing while it is rotated
                aiohttp.ClientError,
                TimeoutError,
                OSError,
            ) as exc:
                reason, error, lasting = stage, f"{type(exc).__name__}: {exc}", _untrusted(exc)
                untrusted = lasting
                self._after_failure(stage, retriable=True)
            except ProtocolError as exc:  # malformed or oversized: what else the stream lost is unknown
                reason, error = stage, f"{type(exc).__name__}: {exc}"
                self._after_failure(stage, retriable=False)
            except Exception as exc:  # a bug in one round must not end discovery for good
                log.exception("pod discovery round failed")
                reason, error = stage, f"{type(exc).__name__}: {exc}"
                self._after_failure(stage, retriable=False)
            sink.record_error(reason, error, lasting=lasting or self._first_list_overdue(error))
            delay_s = self._backoff.next()
            if retry_after_s is not None:
                delay_s = max(delay_s, min(retry_after_s, self._backoff_max_s))
            await self._sleep(delay_s)
            if untrusted:
                return

    def _first_list_overdue(self, error: str) -> bool:
        """Whether readiness has waited `first_list_wait_s` for the first list: from then on every
        error counts as lasting, so that an API server that stays unreachable (or answers what is
        not the Kubernetes API) does not keep the gateway unready for good. Logged once."""
        if self.lists or self._clock() - self._started_s < self._first_list_wait_s:
            return False
        if not self._gave_up_waiting:
            self._gave_up_waiting = True
            log.warning(
                "no list of pods %r after %g s (last error: %s); readiness stops waiting for it: "
                "the pool starts empty and fills once the API server answers",
                self._config.selector,
                self._first_list_wait_s,
                error,
            )
        return True

    def _after_failure(self, stage: str, *, retriable: bool) -> None:
        """What the next round does (module docstring). After a failed list, list again, the
        latest. After a failed watch that lost nothing (`retriable`: a transport error, 429, 5xx),
        watch again from the last version seen, up to `MAX_WATCH_RETRIES` times in a row without
        an event; else list again, no older than that version (the API server may answer it from
        its watch cache rather than with a quorum read of etcd)."""
        if stage == "list":
            self._list_from = None
        elif retriable and self._watch_failures < MAX_WATCH_RETRIES:
            self._watch_failures += 1
        else:
            self._list_from, self._version = self._version, None
            self._watch_failures = 0

    async def _list(self, api: PodApi, sink: WorkerSink) -> str:
        """Every page of the list; the snapshot replaces the last one (this is the resync)."""
        pods: dict[str, PodEndpoint] = {}
        continue_token: str | None = None
        self._warned.clear()
        while True:
            try:
                page = await api.list_page(
                    continue_token, None if continue_token else self._list_from, self._page_size
                )
            except TooLarge:
                if self._page_size == 1:
                    raise
                self._page_size //= 2  # the same page again, smaller: the continue token allows it
                log.warning("a page of pods was too large; asking for %d pods a page", self._page_size)
                continue
            for pod in page.items:
                name = pod_name(pod)
                if name is not None:
                    self._keep(pods, name, pod)
            version, continue_token = page.resource_version, page.continue_token
            page.items.clear()  # not alive while the next page is read and parsed
            if continue_token is None:
                break
        self.lists += 1
        self._list_from = None
        # Pods known before keep their place in the order (past max_pods, which are routed).
        kept = {name: pods[name] for name in self._pods if name in pods}
        self._pods = kept | pods
        sink.publish(self._snapshot())
        return version

    async def _watch(self, api: PodApi, sink: WorkerSink) -> None:
        """One watch stream from `_version`, which follows every event; returns when the server
        ends the stream cleanly."""
        assert self._version is not None
        opened_s = time.monotonic()
        async with contextlib.aclosing(api.watch(self._version)) as stream:
            async for event in stream:
                self._backoff.reset()
                self._watch_failures = 0
                self._version = resource_version(event.object) or self._version
                if event.type == "BOOKMARK":
                    continue
                name = pod_name(event.object)
                if name is None:
                    continue
                before = self._pods.get(name)
                if event.type == "DELETED":
                    self._pods.pop(name, None)
                    self._warned.pop(name, None)
                else:
                    self._keep(self._pods, name, event.object)
                if self._pods.get(name) != before:
                    sink.publish(self._snapshot())
        if time.monotonic() - opened_s < 1.0:
            # A server that ends every watch at once (timeoutSeconds is at least 10), even after a
            # bookmark or two: not a reason to open the next one at once.
            await self._sleep(self._backoff.next())

    def _keep(self, pods: dict[str, PodEndpoint], name: str, pod: Mapping[str, Any]) -> None:
        verdict = read_pod(pod, self._settings)
        if verdict.problem is not None and self._warned.get(name) != verdict.problem:
            if len(self._warned) >= self._config.max_pods:
                self._warned.clear()
            self._warned[name] = verdict.problem
            log.warning("pod %s: %s", name, verdict.problem)
        if verdict.endpoint is None:
            pods.pop(name, None)
        elif name in pods or len(pods) < 2 * self._config.max_pods:
            if name not in pods and len(pods) >= self._config.max_pods:
                log.warning("more than %d ready pods match; %s waits", self._config.max_pods, name)
            pods[name] = verdict.endpoint  # an update keeps the pod's place in the order
        else:
            log.warning("more than %d ready pods match; ignoring %s", 2 * self._config.max_pods, name)

    def _snapshot(self) -> dict[str, WorkerDetails]:
        routed = itertools.islice(self._pods.values(), self._config.max_pods)
        return {p.url: p.details for p in sorted(routed, key=lambda p: p.url)}


def _untrusted(exc: BaseException) -> bool:
    """Whether a transport error is the API server's certificate failing verification (a wrong CA
    bundle, a name the certificate does not carry): waiting will not fix it."""
    return isinstance(
        exc,
        (aiohttp.ClientConnectorCertificateError, aiohttp.ServerFingerprintMismatch, ssl.CertificateError),
    )
