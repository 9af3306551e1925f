"""Hot reload of the routing-policy file.

The watcher polls the file's stat (mtime, ctime, size, inode: a Kubernetes ConfigMap update swaps
a symlink, which changes them all) and, when it moved, reads the file and compares a SHA-256 of the
content, so touching the file or re-mounting identical content rebuilds nothing (a rebuild would
throw away the policy's learned state). A changed file is read, parsed and built completely in a
worker thread, off the event loop (parsing a 1 MiB file takes over a second of CPU), and only then
does the `on_swap` callback see it, on the loop: the gateway swaps one reference and requests
never meet a half-built policy. Building touches nothing shared: it makes a fresh policy object
from the file alone; everything that connects it to the running gateway is `on_swap`'s work.

A file rewritten in place (truncated, then written: a shell's `>`, `cp`, many editors) is
half-written for a moment, and its first half may parse (`epsilon: 0.` for `epsilon: 0.75`, a
file without its `pools` section that throws the prefix index away). So, as for a workers file
(`gateway.file_stamp`), a changed version is read only once it looks whole, and used only if it
stayed the same while it was read: a file that replaced the one read last (another inode: renamed
over it, a ConfigMap's symlink swapped) is read at once unless it is empty; any other change once
this process has seen that version unchanged for the settle time (half the check interval, at most
1 s); a read during which the file's stat moved is thrown away. `reload_now()` waits for the same.

A file that cannot be read, does not parse or build, or is empty keeps the running policy; the
reason is logged and kept in `status()` for the admin API. Its stat is recorded all the same, so a
bad file is one failure however many polls see it, and a further change to it is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from gateway.file_stamp import FileStamp, Settling, read_file, settle_time_s
from policies.base import RoutingPolicy
from policies.config import PolicyConfig, PolicyConfigError, build_policy, parse_policy_yaml

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvgate.policy_watch")

MAX_POLICY_FILE_BYTES = 1024 * 1024
# The check interval is used within these bounds (`policy_reload_interval_s`, docs/config.md).
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 60.0
# How many versions of the file a manual reload waits to settle (or reads) before it gives up on
# a file that a writer keeps changing (each wait is at most the settle time, 1 s).
MANUAL_SETTLE_ROUNDS = 5


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    """A built policy together with the configuration and file content it came from."""

    policy: RoutingPolicy
    config: PolicyConfig
    sha256: str


@dataclass(frozen=True, slots=True)
class PolicyStatus:
    """What the admin API shows: the running policy and the outcome of the last reload attempt."""

    path: str
    policy: str | None = None
    sha256: str | None = None
    loaded_at_unix_s: float | None = None
    reloads: int = 0
    failures: int = 0
    last_error: str | None = None
    last_error_at_unix_s: float | None = None
    last_checked_at_unix_s: float | None = None


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """Outcome of one reload attempt: `swapped` when a new policy is now running."""

    swapped: bool
    unchanged: bool
    error: str | None
    status: PolicyStatus


# The results `kvgate_policy_reloads_total` counts reloads by.
APPLIED, REJECTED, UNCHANGED = "applied", "rejected", "unchanged"

# What the watcher records when the file cannot be stat'ed, so a missing file fails once.
_NO_FILE = FileStamp(-1, -1, -1, -1)


SwapCallback = Callable[[LoadedPolicy], None]


def load_policy_text(text: str, base: Path | None = None) -> LoadedPolicy:
    """Parse and build; raises `PolicyConfigError` naming the problem. Relative paths in the file
    are resolved against `base`, its folder.

    An empty or whitespace-only file is refused rather than read as "all defaults": that is what a
    truncated or half-saved file looks like, and it must not silently change routing.
    """
    if not text.strip():
        raise PolicyConfigError(
            "policy file is empty (a truncated or half-saved file?); write at least `policy: NAME`"
        )
    config = parse_policy_yaml(text, base)
    policy = build_policy(config)
    return LoadedPolicy(policy, config, hashlib.sha256(text.encode()).hexdigest())


def _read_bytes(f: BinaryIO) -> bytes:
    # Its own function so that a test can stand a writer in the middle of a read.
    return f.read(MAX_POLICY_FILE_BYTES + 1)


def _decode(data: bytes) -> str:
    if len(data) > MAX_POLICY_FILE_BYTES:
        raise PolicyConfigError(f"policy file is larger than {MAX_POLICY_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PolicyConfigError("policy file is not UTF-8") from None


class PolicyWatcher:
    """Owns the policy file: the first load, periodic checks and `reload_now()` for the admin API.

    `load_initial()` raises on a bad file (the gateway must not start without a policy); later bad
    files only record an error. Checks run every `interval_s`, taken within `MIN_INTERVAL_S` to
    `MAX_INTERVAL_S` (0.1-60 s), sooner while a changed version settles. `settle_s` defaults to
    `settle_time_s(interval_s)`; `monotonic_s` is the clock a version's settling is timed by.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_swap: SwapCallback,
        interval_s: float = 2.0,
        *,
        settle_s: float | None = None,
        monotonic_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = Path(path)
        self._on_swap = on_swap
        self._interval_s = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, interval_s))
        settle_s = settle_time_s(self._interval_s) if settle_s is None else settle_s
        self._settling = Settling(settle_s, monotonic_s)  # knows the version read last
        self._stamp: FileStamp | None = None  # the version read last (applied or not)
        self._status = PolicyStatus(path=str(self._path))
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.moved_reads = 0  # reads thrown away because the file changed while it was read
        # What the last failure logged was about (a content's digest, or a reason that is no
        # content's): each rejected content is logged once, however many polls or calls meet it.
        self._logged_failure: str | None = None
        self._metrics: GatewayMetrics | None = None

    def status(self) -> PolicyStatus:
        return self._status

    def export_to(self, metrics: GatewayMetrics) -> None:
        """Count each reload's result in `metrics` from now on (`kvgate_policy_reloads_total`,
        `kvgate_policy_reload_failing`); every result's series exists from here, at 0."""
        self._metrics = metrics
        for result in (APPLIED, REJECTED, UNCHANGED):
            metrics.policy_reloads.labels(result)
        metrics.policy_reload_failing.set(1 if self._status.last_error is not None else 0)

    def load_initial(self) -> LoadedPolicy:
        """Synchronous first load at startup; raises `PolicyConfigError` or `OSError`. A file that
        changes while it is read is taken as read: its new stamp differs, so the first check
        settles and reads it."""
        read = read_file(self._path, _read_bytes)
        try:
            loaded = load_policy_text(_decode(read.data), self._path.parent)
        except PolicyConfigError as exc:
            raise PolicyConfigError(f"{self._path}: {exc}") from None
        self._stamp, self._settling.inode = read.stamp, read.stamp.inode
        self._mark_loaded(loaded)
        return loaded

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="policy-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def check(self) -> ReloadResult | None:
        """Reload if the file's stat moved since the last attempt and the new version has settled;
        None when nothing was tried (unchanged, settling, or changed while it was read)."""
        result, _ = await self._check()
        return result

    async def reload_now(self, force: bool = False) -> ReloadResult:
        """Read, parse and build the file now; swap if its content changed (or `force`).

        A version rewritten in place is waited for until it settles (at most the settle time a
        version, `MANUAL_SETTLE_ROUNDS` versions), as the watcher would. Versions are counted, not
        wakeups: a timer may wake the wait before the clock says the settle time has passed
        (uvloop's count whole milliseconds), and the rest of the same version's wait is no new
        version. A read the file changed under counts as one. The read, parse and build run in a
        worker thread; only the swap runs on the event loop.
        """
        async with self._lock:
            versions = 0
            version: FileStamp | None = None  # the one this call waits for or read last
            while True:
                try:
                    stamp = await asyncio.to_thread(self._stat)
                except OSError as exc:
                    return self._fail(f"cannot stat policy file: {exc.strerror or exc}")
                if stamp != version:
                    versions += 1
                    if versions > MANUAL_SETTLE_ROUNDS:
                        return self._fail(
                            "the policy file kept changing while it was read; nothing was applied "
                            "(write it elsewhere and rename it over the file)"
                        )
                    version = stamp
                if stamp != self._stamp:
                    wait_s = self._settling.wait_s(stamp)
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)  # then stat again: a write meanwhile waits anew
                        continue
                # A manual reload (`POST /admin/policy/reload`, SIGHUP) is a check of the file too.
                result = await self._read_and_apply(stamp, force)
                if result is not None:
                    return result
                version = None  # changed while it was read: what the next stat sees is another

    # internals ------------------------------------------------------------
    async def _check(self) -> tuple[ReloadResult | None, float]:
        """One stat check, and a reload of a changed version that has settled; with the time to
        the next check (sooner while a version settles)."""
        try:
            stamp = await asyncio.to_thread(self._stat)
        except OSError as exc:
            if self._stamp == _NO_FILE:
                return None, self._interval_s
            # The file read last is gone: whatever appears at the path next replaces it, even if
            # the file system hands it the same inode.
            self._stamp, self._settling.inode = _NO_FILE, -1
            return self._fail(f"cannot stat policy file: {exc.strerror or exc}"), self._interval_s
        self._status = replace(self._status, last_checked_at_unix_s=time.time())
        if stamp == self._stamp:
            self._settling.forget()
            return None, self._interval_s
        wait_s = self._settling.wait_s(stamp)
        if wait_s > 0:
            return None, min(wait_s, self._interval_s)
        async with self._lock:
            if stamp == self._stamp:  # a manual reload read it meanwhile
                return None, self._interval_s
            return await self._read_and_apply(stamp, force=False), self._interval_s

    async def _read_and_apply(self, stamp: FileStamp, force: bool) -> ReloadResult | None:
        """Read the version with `stamp`, then parse, build and swap it unless its content is the
        running policy's (or `force`); None when the file changed while it was read (nothing of
        that read is used). Runs under the lock."""
        self._status = replace(self._status, last_checked_at_unix_s=time.time())
        try:
            read = await asyncio.to_thread(read_file, self._path, _read_bytes)
        except OSError as exc:
            self._stamp = stamp
            return self._fail(f"cannot read policy file: {exc.strerror or exc}")
        if read.moved or read.stamp != stamp:
            # Not the version the stat saw, start to end: a writer was at work. The next check
            # sees the stamp it left.
            self.moved_reads += 1
            log.debug("%s changed while it was read; read again at the next check", self._path)
            return None
        # Recorded before the outcome is known: `check()` tries each version of the file once.
        self._stamp, self._settling.inode = stamp, stamp.inode
        self._settling.forget()
        digest = hashlib.sha256(read.data).hexdigest()  # of the text's UTF-8: `LoadedPolicy.sha256`
        try:
            text = _decode(read.data)
        except PolicyConfigError as exc:
            return self._fail(str(exc), content=digest)
        if digest == self._status.sha256 and not force:
            # Same content as the running policy (e.g. a bad edit reverted): nothing to rebuild.
            self._status = replace(self._status, last_error=None, last_error_at_unix_s=None)
            self._logged_failure = None
            self._count(UNCHANGED)
            return ReloadResult(swapped=False, unchanged=True, error=None, status=self._status)
        try:
            loaded = await asyncio.to_thread(load_policy_text, text, self._path.parent)
        except PolicyConfigError as exc:
            return self._fail(str(exc), content=digest)
        try:
            self._on_swap(loaded)
        except Exception as exc:
            log.exception("policy swap callback failed")
            return self._fail(f"swap failed: {type(exc).__name__}: {exc}", content=digest)
        self._mark_loaded(loaded, reload=True)
        self._count(APPLIED)
        log.info("policy reloaded: %s (sha256 %s)", loaded.config.policy, digest[:12])
        return ReloadResult(swapped=True, unchanged=False, error=None, status=self._status)

    def _stat(self) -> FileStamp:
        st = self._path.stat()
        return FileStamp.of(st)

    def _mark_loaded(self, loaded: LoadedPolicy, reload: bool = False) -> None:
        self._status = replace(
            self._status,
            policy=loaded.config.policy,
            sha256=loaded.sha256,
            loaded_at_unix_s=time.time(),
            reloads=self._status.reloads + (1 if reload else 0),
            last_error=None,
            last_error_at_unix_s=None,
        )
        self._logged_failure = None

    def _fail(self, reason: str, content: str | None = None) -> ReloadResult:
        """Record a rejected attempt; logged once per rejected content (`content`, its digest), or
        once per reason for a file that could not be read, however often it is met again."""
        key = content or f"no content: {reason}"
        if key != self._logged_failure:
            self._logged_failure = key
            log.error("policy reload rejected, keeping %s: %s", self._status.policy, reason)
        self._count(REJECTED)
        self._status = replace(
            self._status,
            failures=self._status.failures + 1,
            last_error=reason,
            last_error_at_unix_s=time.time(),
        )
        return ReloadResult(swapped=False, unchanged=False, error=reason, status=self._status)

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.policy_reloads.labels(result).inc()
            self._metrics.policy_reload_failing.set(1 if result == REJECTED else 0)

    async def _poll(self) -> None:
        delay_s = self._interval_s
        while True:
            await asyncio.sleep(delay_s)
            try:
                _, delay_s = await self._check()
            except Exception:
                # The watcher must outlive any surprise; the running policy stays in place.
                log.exception("policy check failed")
                delay_s = self._interval_s
