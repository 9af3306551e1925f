"""Workers listed in a file (`pools[].workers_file`), followed as it changes: the discovery of
fleets that no DNS name or Kubernetes API describes (machines, a batch scheduler's nodes), written
by whatever provisions them (a deploy script, Ansible, a mounted ConfigMap). Every gateway process
and replica reads the same file, so they follow one worker set without any call to each.

The file is YAML (or JSON): a list of worker base URLs, or a mapping whose `workers` key holds
that list; an entry is a URL or `{url: ..., role: prefill | decode}` (a role only in a P/D pool
that takes roles). It is read at start (a missing or invalid file stops the start, naming why),
then its stat is checked every `refresh_s` and a changed file read again, off the event loop. A
file that cannot be read or is invalid, half-written or lists no worker keeps the last set, and is
counted and logged once (`kvgate_discovery_errors_total{reason="file"}`) until it changes again.
Bounded: 1 MiB, 1,024 workers, the YAML's aliases as for the policy file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.discovery import WorkerDetails, WorkerSink
from gateway.file_stamp import FileStamp, stamp
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


class FileWorkers:
    """A `WatchingSource` over one workers file (module docstring)."""

    def __init__(self, path: str, *, refresh_s: float = 2.0, roles: bool = False) -> None:
        self.path = path
        self.refresh_s = refresh_s
        self.roles = roles
        self._stamp: FileStamp | None = None
        self._failed: FileStamp | None = None
        self._first: dict[str, WorkerDetails] | None = None
        self.polls = 0  # stat checks made

    async def prepare(self) -> None:
        """Read the file once: a missing or invalid file stops the start."""
        stamp, workers = await asyncio.to_thread(self._read)
        self._stamp, self._first = stamp, workers

    async def run(self, sink: WorkerSink) -> None:
        if self._first is None:
            await self.prepare()
        assert self._first is not None
        sink.publish(self._first)
        self._first = None
        while True:
            await asyncio.sleep(self.refresh_s)
            self.polls += 1
            stamp = None
            try:
                stamp = await asyncio.to_thread(self._stat)
                if stamp == self._stamp or stamp == self._failed:
                    continue
                stamp, workers = await asyncio.to_thread(self._read)
            except (OSError, WorkersFileError) as exc:
                failed = _NO_FILE if stamp is None else stamp
                if failed != self._failed:
                    # Once per version of the file (a missing one is one version): the last set stays.
                    self._failed = failed
                    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                    sink.record_error("file", f"{self.path}: {reason}; keeping the last set")
                continue
            self._stamp, self._failed = stamp, None
            sink.publish(workers)

    def _stat(self) -> FileStamp:
        return stamp(self.path)

    def check(self) -> None:
        """Read the file now, as `prepare` does, without keeping it (`kvgate serve` before it
        serves); raises `OSError` or `WorkersFileError`."""
        self._read()

    def _read(self) -> tuple[FileStamp, dict[str, WorkerDetails]]:
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise WorkersFileError(f"larger than {MAX_FILE_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise WorkersFileError("not UTF-8") from None
        return FileStamp.of(st), parse_workers(text, roles=self.roles)
