"""Workers listed in a file (`pools[].workers_file`), followed as it changes: the discovery of
fleets that no DNS name or Kubernetes API describes (machines, a batch scheduler's nodes), written
by whatever provisions them (a deploy script, Ansible, a mounted ConfigMap). Every gateway process
and replica reads the same file, so they follow one worker set without any call to each.

The file is YAML (or JSON): a list of worker base URLs, or a mapping whose `workers` key holds
that list; an entry is a URL or `{url: ..., role: prefill | decode}` (a role only in a P/D pool
that takes roles). It is read at start (a missing or invalid file stops the start, naming why),
then its stat is checked every `refresh_s` and a changed file read again, off the event loop.

A file rewritten in place (truncated, then written: a shell's `>`, many editors, a script's
`open("w")`) is half-written for a moment, and the first half of a YAML list is a valid list of
fewer workers. So a changed version is read only once it looks whole, and used only if it stayed
the same while it was read:
- a file that replaced the one read last (another inode: renamed over it, a ConfigMap's symlink
  swapped) is whole when it appears, and is read at the check that sees it, unless it is empty;
- any other change is read once this process has seen that version unchanged for `settle_s`:
  half of `refresh_s`, at most 1 s (`settle_time_s`), checked again as soon as that has passed.
  The file's modification time does not count: on a shared file system (NFS, EFS) it is the
  server's clock, which may run behind ours, and some file systems keep it to the second;
- a read during which the file's stat (inode, size, times) moved is thrown away, and the next
  check sees what its writer left.
A writer that pauses longer than `settle_s` in the middle of a rewrite in place, or writes a new
file at the path in pieces, can still be read half-done: write elsewhere and rename it in.

A file that cannot be read or is invalid or lists no worker keeps the last set, and is counted and
logged once (`kvgate_discovery_errors_total{reason="file"}`) until it changes again.
Bounded: 1 MiB, 1,024 workers, the YAML's aliases as for the policy file.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import yaml

from gateway.discovery import WorkerDetails, WorkerSink
from gateway.file_stamp import FileRead, FileStamp, Settling, read_file, settle_time_s, stamp
from policies.operator_yaml import OperatorYamlError, load_operator_yaml

log = logging.getLogger("kvgate.discovery")

MAX_FILE_BYTES = 1 << 20
MAX_WORKERS = 1024
ROLES = ("prefill", "decode")


# The stamp of a file that cannot be stat'ed (missing, unreadable folder): one version of its own.
_NO_FILE = FileStamp(-1, -1, -1, -1)


class WorkersFileError(ValueError):
    """The file cannot be used as a worker list; the message says why (never its content)."""


def parse_workers(text: str, *, roles: bool) -> dict[str, WorkerDetails]:
    """The worker set a file's text lists, by URL; `roles`: whether entries may carry one."""
    try:
        doc = load_operator_yaml(text)
    except OperatorYamlError as exc:
        raise WorkersFileError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise WorkersFileError(f"not valid YAML: {exc}") from None
    entries = doc.get("workers") if isinstance(doc, dict) and set(doc) == {"workers"} else doc
    if not isinstance(entries, list):
        raise WorkersFileError("expected a list of worker URLs, or a mapping with one key, `workers`")
    if not entries:
        raise WorkersFileError("it lists no worker (a half-written file?)")
    if len(entries) > MAX_WORKERS:
        raise WorkersFileError(f"{len(entries)} workers: at most {MAX_WORKERS}")
    out: dict[str, WorkerDetails] = {}
    for i, entry in enumerate(entries):
        url, role = _entry(i, entry)
        if role is not None and not roles:
            raise WorkersFileError(f"entry {i}: a role, but this pool's workers are all mixed")
        if url in out:
            raise WorkersFileError(f"entry {i}: {url} is listed twice")
        out[url] = WorkerDetails(role=role)
    return out


def _entry(i: int, entry: Any) -> tuple[str, str | None]:
    role = None
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"url", "role"})
        if unknown:
            raise WorkersFileError(f"entry {i}: unknown key {str(unknown[0])[:64]!r} (url, role)")
        role = entry.get("role")
        if role is not None and role not in ROLES:
            raise WorkersFileError(f"entry {i}: role must be prefill or decode")
        entry = entry.get("url")
    if not isinstance(entry, str):
        raise WorkersFileError(f"entry {i}: a worker is a URL string or a mapping with `url`")
    url = entry.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise WorkersFileError(f"entry {i}: not a valid URL") from None
    if "@" in parts.netloc:
        raise WorkersFileError(
            f"entry {i}: a worker URL must not carry credentials (user:password@host): give the "
            "workers' key as worker_api_key_file or worker_api_key_env"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise WorkersFileError(f"entry {i}: a worker is a base URL, http(s)://host:port")
    if _partial_address(parts.hostname):
        raise WorkersFileError(f"entry {i}: a host of digits and dots is an IPv4 address of four numbers")
    return url, role


def _partial_address(host: str) -> bool:
    """A host of numbers (decimal, or hexadecimal `0x..`) and dots that is not a whole dotted-quad
    IPv4 address written plainly: `10.0.0` or `127`, which resolvers read as shorthand
    (`10.0.0.0`, `0.0.0.127`) and a file cut short mid-write leaves behind, and `010.0.0.1` or
    `0x7f.1`, which they read as octal or hexadecimal (`8.0.0.1`, `127.0.0.1`)."""
    if _NUMERIC_HOST.fullmatch(host) is None:
        return False
    return _DOTTED_QUAD.fullmatch(host) is None


_NUMBER = r"(?:0[xX][0-9a-fA-F]*|[0-9]+)"
_NUMERIC_HOST = re.compile(rf"{_NUMBER}(?:\.{_NUMBER})*\.?")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def _read_file(path: str) -> FileRead:
    return read_file(path, _read_bytes)


def _read_bytes(f: BinaryIO) -> bytes:
    # Its own function so that a test can stand a writer in the middle of a read.
    return f.read(MAX_FILE_BYTES + 1)


def _decode(data: bytes) -> str:
    if len(data) > MAX_FILE_BYTES:
        raise WorkersFileError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise WorkersFileError("not UTF-8") from None


class FileWorkers:
    """A `WatchingSource` over one workers file (module docstring). `settle_s` defaults to
    `settle_time_s(refresh_s)`; `monotonic_s` is the clock a version's settling is timed by."""

    def __init__(
        self,
        path: str,
        *,
        refresh_s: float = 2.0,
        roles: bool = False,
        settle_s: float | None = None,
        monotonic_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.refresh_s = refresh_s
        self.roles = roles
        self.settle_s = settle_time_s(refresh_s) if settle_s is None else settle_s
        self._stamp: FileStamp | None = None  # the version published last
        self._failed: FileStamp | None = None  # the version that failed last, counted once
        self._settling = Settling(self.settle_s, monotonic_s)  # knows the version read last
        self._first: dict[str, WorkerDetails] | None = None
        self.polls = 0  # stat checks made
        self.moved_reads = 0  # reads thrown away because the file changed while it was read

    async def prepare(self) -> None:
        """Read the file once: a missing or invalid file stops the start. A file that changes
        while it is read is taken as read: its new stamp differs, so the next check settles it."""
        stamp, workers = await asyncio.to_thread(self._load)
        self._stamp, self._settling.inode, self._first = stamp, stamp.inode, workers

    async def run(self, sink: WorkerSink) -> None:
        if self._first is None:
            await self.prepare()
        assert self._first is not None
        sink.publish(self._first)
        self._first = None
        delay_s = self.refresh_s
        while True:
            await asyncio.sleep(delay_s)
            self.polls += 1
            delay_s = await self._check(sink)

    async def _check(self, sink: WorkerSink) -> float:
        """One stat check, and a read and publish of a changed version that has settled; returns
        the time to the next check (sooner while a version settles)."""
        stamp = None
        try:
            stamp = await asyncio.to_thread(self._stat)
            if stamp == self._stamp or stamp == self._failed:
                self._settling.forget()
                return self.refresh_s
            wait_s = self._settling.wait_s(stamp)
            if wait_s > 0:
                return min(wait_s, self.refresh_s)
            read = await asyncio.to_thread(_read_file, self.path)
            if read.moved or read.stamp != stamp:
                # Not the version the stat saw, start to end: a writer was at work. Nothing read
                # is used; the next check sees the stamp it left.
                self.moved_reads += 1
                log.debug("%s changed while it was read; read again at the next check", self.path)
                return self.refresh_s
            self._settling.inode = stamp.inode  # read, whether or not it parses
            workers = await asyncio.to_thread(self._parse, read.data)
        except (OSError, WorkersFileError) as exc:
            failed = _NO_FILE if stamp is None else stamp
            if failed != self._failed:
                # Once per version of the file (a missing one is one version): the last set stays.
                self._failed = failed
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                sink.record_error("file", f"{self.path}: {reason}; keeping the last set")
            return self.refresh_s
        self._stamp, self._failed = stamp, None
        self._settling.forget()
        sink.publish(workers)
        return self.refresh_s

    def _stat(self) -> FileStamp:
        return stamp(self.path)

    def check(self) -> None:
        """Read the file now, as `prepare` does, without keeping it (`kvgate serve` before it
        serves); raises `OSError` or `WorkersFileError`."""
        self._load()

    def _load(self) -> tuple[FileStamp, dict[str, WorkerDetails]]:
        read = _read_file(self.path)
        return read.stamp, self._parse(read.data)

    def _parse(self, data: bytes) -> dict[str, WorkerDetails]:
        return parse_workers(_decode(data), roles=self.roles)
