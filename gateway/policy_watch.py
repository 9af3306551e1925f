"""Hot reload of the routing-policy file.

The watcher polls the file's stat (mtime, ctime, size, inode: a Kubernetes ConfigMap update swaps
a symlink, which changes them all) and, when it moved, reads the file and compares a SHA-256 of the
content, so touching the file or re-mounting identical content rebuilds nothing (a rebuild would
throw away the policy's learned state). A changed file is read, parsed and built completely in a
worker thread, off the event loop (parsing a 1 MiB file takes over a second of CPU), and only then
does the `on_swap` callback see it, on the loop: the gateway swaps one reference and requests
never meet a half-built policy. Building touches nothing shared: it makes a fresh policy object
from the file alone; everything that connects it to the running gateway is `on_swap`'s work.

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

from gateway.file_stamp import FileStamp
from policies.base import RoutingPolicy
from policies.config import PolicyConfig, PolicyConfigError, build_policy, parse_policy_yaml

log = logging.getLogger("kvgate.policy_watch")

MAX_POLICY_FILE_BYTES = 1024 * 1024


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


# What the watcher records when the file cannot be stat'ed, so a missing file fails once.
_NO_FILE = FileStamp(-1, -1, -1, -1)


@dataclass(frozen=True, slots=True)
class _Content:
    text: str
    sha256: str


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


def _read(path: Path) -> str:
    with path.open("rb") as f:
        data = f.read(MAX_POLICY_FILE_BYTES + 1)
    if len(data) > MAX_POLICY_FILE_BYTES:
        raise PolicyConfigError(f"policy file is larger than {MAX_POLICY_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PolicyConfigError("policy file is not UTF-8") from None


def _read_content(path: Path) -> _Content:
    text = _read(path)
    return _Content(text, hashlib.sha256(text.encode()).hexdigest())


class PolicyWatcher:
    """Owns the policy file: the first load, periodic checks and `reload_now()` for the admin API.

    `load_initial()` raises on a bad file (the gateway must not start without a policy); later bad
    files only record an error. Checks run every `interval_s` (clamped to 0.1-60 s).
    """

    def __init__(self, path: str | os.PathLike[str], on_swap: SwapCallback, interval_s: float = 2.0) -> None:
        self._path = Path(path)
        self._on_swap = on_swap
        self._interval_s = min(60.0, max(0.1, interval_s))
        self._stamp: FileStamp | None = None
        self._status = PolicyStatus(path=str(self._path))
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def status(self) -> PolicyStatus:
        return self._status

    def load_initial(self) -> LoadedPolicy:
        """Synchronous first load at startup; raises `PolicyConfigError` or `OSError`."""
        stamp = self._stat()
        try:
            loaded = load_policy_text(_read(self._path), self._path.parent)
        except PolicyConfigError as exc:
            raise PolicyConfigError(f"{self._path}: {exc}") from None
        self._stamp = stamp
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
        """Reload if the file's stat moved since the last attempt; None when it did not."""
        try:
            stamp = await asyncio.to_thread(self._stat)
        except OSError as exc:
            if self._stamp == _NO_FILE:
                return None
            self._stamp = _NO_FILE
            return self._fail(f"cannot stat policy file: {exc.strerror or exc}")
        self._status = replace(self._status, last_checked_at_unix_s=time.time())
        if stamp == self._stamp:
            return None
        return await self.reload_now(_stamp=stamp)

    async def reload_now(self, force: bool = False, _stamp: FileStamp | None = None) -> ReloadResult:
        """Read, parse and build the file now; swap if its content changed (or `force`).

        The read, parse and build run in a worker thread; only the swap runs on the event loop.
        """
        async with self._lock:
            try:
                stamp = _stamp or await asyncio.to_thread(self._stat)
            except OSError as exc:
                return self._fail(f"cannot stat policy file: {exc.strerror or exc}")
            # Recorded before the outcome is known: `check()` tries each version of the file once.
            # A manual reload (`POST /admin/policy/reload`) is a check of the file as well.
            self._stamp = stamp
            self._status = replace(self._status, last_checked_at_unix_s=time.time())
            try:
                content = await asyncio.to_thread(_read_content, self._path)
            except OSError as exc:
                return self._fail(f"cannot read policy file: {exc.strerror or exc}")
            except PolicyConfigError as exc:
                return self._fail(str(exc))
            digest = content.sha256
            if digest == self._status.sha256 and not force:
                # Same content as the running policy (e.g. a bad edit reverted): nothing to rebuild.
                self._status = replace(self._status, last_error=None, last_error_at_unix_s=None)
                return ReloadResult(swapped=False, unchanged=True, error=None, status=self._status)
            try:
                loaded = await asyncio.to_thread(load_policy_text, content.text, self._path.parent)
            except PolicyConfigError as exc:
                return self._fail(str(exc))
            try:
                self._on_swap(loaded)
            except Exception as exc:
                log.exception("policy swap callback failed")
                return self._fail(f"swap failed: {type(exc).__name__}: {exc}")
            self._mark_loaded(loaded, reload=True)
            log.info("policy reloaded: %s (sha256 %s)", loaded.config.policy, digest[:12])
            return ReloadResult(swapped=True, unchanged=False, error=None, status=self._status)

    # internals ------------------------------------------------------------
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

    def _fail(self, reason: str) -> ReloadResult:
        if reason != self._status.last_error:
            log.error("policy reload rejected, keeping %s: %s", self._status.policy, reason)
        self._status = replace(
            self._status,
            failures=self._status.failures + 1,
            last_error=reason,
            last_error_at_unix_s=time.time(),
        )
        return ReloadResult(swapped=False, unchanged=False, error=reason, status=self._status)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception:
                # The watcher must outlive any surprise; the running policy stays in place.
                log.exception("policy check failed")
