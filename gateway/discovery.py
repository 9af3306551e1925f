"""Where a pool's workers are: a static URL list, a DNS name re-resolved periodically, or a source
that pushes its own updates (the Kubernetes pod watch in `gateway.k8s`).

The static list and the DNS name are `gateway.worker_sources`'s; this module follows any source.

Every kind of source ends in the same seam: `Discovery.publish(snapshot)` diffs the new snapshot
against the last one and hands a `WorkerSetChange` to the one change handler (the fleet's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.worker_sources import WorkerSource

log = logging.getLogger("kvgate.discovery")


@dataclass(frozen=True, slots=True)
class WorkerDetails:
    """What a source knows about a worker besides its URL (static and DNS sources know nothing more).

    `role` is the value of the pod's role label (e.g. prefill, decode, mixed); `kv_events_endpoint`
    the worker's own KV-event publisher, when the source finds it per worker.
    """

    role: str | None = None
    kv_events_endpoint: str | None = None


NO_DETAILS = WorkerDetails()


@dataclass(frozen=True, slots=True)
class WorkerSetChange:
    """The difference between two successive views of a pool: URLs added and removed, and URLs
    kept whose details changed. `details` holds the current workers' details (absent: none)."""

    added: frozenset[str]
    removed: frozenset[str]
    current: frozenset[str]
    changed: frozenset[str] = frozenset()
    details: Mapping[str, WorkerDetails] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def details_of(self, url: str) -> WorkerDetails:
        return self.details.get(url, NO_DETAILS)


def diff_workers(
    old: frozenset[str],
    new: frozenset[str],
    old_details: Mapping[str, WorkerDetails] | None = None,
    new_details: Mapping[str, WorkerDetails] | None = None,
) -> WorkerSetChange:
    before, after = old_details or {}, new_details or {}
    changed = frozenset(u for u in old & new if before.get(u, NO_DETAILS) != after.get(u, NO_DETAILS))
    return WorkerSetChange(
        added=new - old, removed=old - new, current=new, changed=changed, details=dict(after)
    )


class WorkerSink(Protocol):
    """Where a watching source reports: whole snapshots, errors and re-lists."""

    def publish(self, workers: Mapping[str, WorkerDetails]) -> WorkerSetChange: ...

    def record_error(self, reason: str, message: str, *, lasting: bool = False) -> None: ...

    def record_resync(self) -> None: ...


class WatchingSource(Protocol):
    """A source that follows its workers itself (a Kubernetes watch) and pushes every snapshot.

    `prepare` checks what cannot heal by waiting (credentials, settings) and raises if it is wrong.
    `run` then never returns by itself: it reports to `sink` until cancelled, and recovers from its
    own errors (reporting each through `sink.record_error`, with `lasting=True` for one that
    waiting is not expected to fix, such as a 403: readiness stops waiting for the first snapshot).
    """

    async def prepare(self) -> None: ...

    async def run(self, sink: WorkerSink) -> None: ...


@dataclass(frozen=True, slots=True)
class DiscoveryStatus:
    """What the admin API shows for one pool's discovery."""

    workers: frozenset[str]
    resolutions: int
    failures: int
    last_error: str | None
    resyncs: int = 0


ErrorHook = Callable[[str], None]


class Discovery:
    """Keeps a pool's worker set current and reports each change.

    A polled source (`WorkerSource`) is resolved every `interval_s`; a `WatchingSource` runs in a
    task of its own and calls `publish`. Use `watch()` (polled sources) as an async iterator, or
    `start(on_change)` / `stop()` from the app lifespan. The first change reported is the initial
    set (everything `added`). `on_error(reason)` and `on_resync()` feed the metrics.

    A polled source that answers with no workers empties a pool that has some only after
    `empty_after` such answers in a row spanning `empty_after_s` (see the module docstring); until
    then each one is recorded as an error of reason `no_addresses` and the last set stays.
    `clock` (monotonic seconds) is replaceable for tests.
    """

    def __init__(
        self,
        source: WorkerSource | WatchingSource,
        interval_s: float = 5.0,
        *,
        on_error: ErrorHook | None = None,
        on_resync: Callable[[], None] | None = None,
        first_wait_s: float = 5.0,
        name: str = "",
        empty_after: int = 2,
        empty_after_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        if empty_after < 1:
            raise ValueError("empty_after must be >= 1")
        if empty_after_s < 0:
            raise ValueError("empty_after_s must be >= 0")
        self._source = source
        self._interval_s = interval_s
        self._on_error = on_error
        self._on_resync = on_resync
        self._first_wait_s = first_wait_s
        self._empty_after = empty_after
        self._empty_after_s = empty_after_s
        self._clock = clock
        self._empty_answers = 0  # answers of no workers in a row, while the pool still had some
        self._first_empty_s = 0.0  # when the first of them came
        self._log_extra = {"pool": name} if name else None
        self._current: frozenset[str] = frozenset()
        self._details: Mapping[str, WorkerDetails] = {}
        self._resolutions = 0
        self._failures = 0
        self._resyncs = 0
        self._last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False  # `stop` cancelled the task: its end is no crash
        self._on_change: Callable[[WorkerSetChange], None] | None = None
        self._answered = asyncio.Event()  # a watching source has published once, or failed once
        self._settled = False  # see `settled`

    @property
    def current(self) -> frozenset[str]:
        return self._current

    @property
    def settled(self) -> bool:
        """Whether the pool's first set is known: a polled source has been resolved once (found or
        not: a DNS name's next lookup may differ, but nothing was left to wait for), a watching
        source has published once, failed with an error waiting will not fix (`lasting`), or
        ended (a crash: the pool stays as it stands)."""
        return self._settled

    def status(self) -> DiscoveryStatus:
        return DiscoveryStatus(
            self._current, self._resolutions, self._failures, self._last_error, self._resyncs
        )

    def publish(self, workers: Mapping[str, WorkerDetails]) -> WorkerSetChange:
        """Take a whole new snapshot from a watching source and report the change to the handler."""
        change = self._take(workers)
        if self._on_change is not None and change:
            self._deliver(change)
        return change

    def _take(self, workers: Mapping[str, WorkerDetails]) -> WorkerSetChange:
        self._resolutions += 1
        self._last_error = None
        new = frozenset(workers)
        change = diff_workers(self._current, new, self._details, workers)
        self._current, self._details = new, change.details
        if change:
            log.info(
                "workers changed: +%d -%d ~%d = %d",
                len(change.added),
                len(change.removed),
                len(change.changed),
                len(new),
                extra=self._log_extra,
            )
        self._answered.set()
        self._settled = True
        return change

    def record_error(self, reason: str, message: str, *, lasting: bool = False) -> None:
        """A failed resolution or watch: the last set stays. A `lasting` error (one that waiting is
        not expected to fix) settles the pool as a snapshot does: it starts empty."""
        self._failures += 1
        self._last_error = f"{reason}: {message}"
        log.warning(
            "worker discovery failed, keeping %d workers: %s",
            len(self._current),
            self._last_error,
            extra=self._log_extra,
        )
        if self._on_error is not None:
            self._on_error(reason)
        self._answered.set()
        if lasting:
            self._settled = True

    def record_resync(self) -> None:
        """A watching source lists everything again (after a watch error or an expired version)."""
        self._resyncs += 1
        if self._on_resync is not None:
            self._on_resync()

    async def refresh(self) -> WorkerSetChange:
        """Resolve a polled source once; on failure, or on an answer of no workers not yet given
        `empty_after` times in a row, keep the last set and return an empty change."""
        if not isinstance(self._source, WorkerSource):
            raise TypeError("refresh() needs a polled WorkerSource")
        try:
            new = await self._source.resolve()
        except (OSError, TimeoutError, ValueError) as exc:
            self.record_error("resolve", f"{type(exc).__name__}: {exc}")
            return diff_workers(self._current, self._current)
        if new:
            self._empty_answers = 0
        elif self._current:
            now_s = self._clock()
            if self._empty_answers == 0:
                self._first_empty_s = now_s
            self._empty_answers += 1
            span_s = now_s - self._first_empty_s
            answers = f"{self._empty_answers} of {self._empty_after} answers in a row"
            if self._empty_after_s:
                answers += f", over {span_s:.1f} of {self._empty_after_s:g} s"
            if self._empty_answers < self._empty_after or span_s < self._empty_after_s:
                self.record_error("no_addresses", f"no workers ({answers})")
                return diff_workers(self._current, self._current)
            log.warning("no workers (%s): the pool is empty", answers, extra=self._log_extra)
            self._empty_answers = 0
        return self._take(dict.fromkeys(new, NO_DETAILS))

    async def watch(self) -> AsyncIterator[WorkerSetChange]:
        """Yield every non-empty change of a polled source, forever if periodic, once if static."""
        if not isinstance(self._source, WorkerSource):
            raise TypeError("watch() needs a polled WorkerSource")
        while True:
            change = await self.refresh()
            if change:
                yield change
            if not self._source.periodic:
                return
            await asyncio.sleep(self._interval_s)

    async def start(self, on_change: Callable[[WorkerSetChange], None]) -> WorkerSetChange:
        """Resolve now (so the pool starts populated), then keep following in a background task.

        A watching source is prepared (its setup errors are raised here), then gets up to
        `first_wait_s` to publish its first snapshot or fail once; after that the pool starts with
        what is known and fills up as the source reports (`settled` says when it has).
        """
        if isinstance(self._source, WorkerSource):
            first = await self.refresh()
            self._settled = True
            on_change(first)
            if self._source.periodic:
                self._task = asyncio.create_task(self._poll(on_change), name="discovery")
            return first
        await self._source.prepare()
        self._on_change = on_change
        self._task = asyncio.create_task(self._source.run(self), name="discovery")
        self._task.add_done_callback(self._ended)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._first_wait_s):
                await self._answered.wait()
        return diff_workers(frozenset(), self._current, None, self._details)

    async def _poll(self, on_change: Callable[[WorkerSetChange], None]) -> None:
        self._on_change = on_change
        while True:
            await asyncio.sleep(self._interval_s)
            change = await self.refresh()
            if change:
                self._deliver(change)

    def _deliver(self, change: WorkerSetChange) -> None:
        """Hand a change to the handler; a failing handler must not end discovery."""
        assert self._on_change is not None
        try:
            self._on_change(change)
        except Exception:
            log.exception("worker-set change handler failed")

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A watching source ends only when cancelled; anything else is a bug: logged with its
        traceback, counted (reason `crashed`), and the pool settles as it stands, since readiness
        would otherwise wait for good for a source that will never report again."""
        if task.cancelled() or self._stopping:
            return  # stopped: a source that swallowed the cancel, or failed in its cleanup
        exc = task.exception()
        log.error(
            "worker discovery stopped; the pool keeps its %d workers and follows them no more",
            len(self._current),
            exc_info=exc,
            extra=self._log_extra,
        )
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "the source returned"
        self.record_error("crashed", what, lasting=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            # A task that already died was reported by `_ended`; stopping must still succeed.
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
