"""Workers listed in a file (`gateway.file_discovery`): what a file may say, and following it as it
changes: a version rewritten in place is read only once its writer is done, a whole file renamed
in is read at once, and the last set stays while the file is missing or invalid."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import pytest

from gateway import file_discovery
from gateway.config import load_config
from gateway.config.base import ConfigError
from gateway.discovery import WorkerDetails, WorkerSetChange, diff_workers
from gateway.file_discovery import (
    MAX_WORKERS,
    FileWorkers,
    WorkersFileError,
    parse_workers,
    settle_time_s,
)
from tests.support.wait import wait_until


def test_a_list_or_a_mapping_of_urls_and_roles() -> None:
    assert list(parse_workers("- http://a:8000\n- https://b:8443/\n", roles=False)) == [
        "http://a:8000",
        "https://b:8443",
    ]
    hosts = "- http://10.0.0.1\n- http://[::1]:80\n- http://worker-0.x\n- http://1a.b\n"
    assert len(parse_workers(hosts, roles=False)) == 4
    parsed = parse_workers(
        '{"workers": ["http://a:1", {"url": "http://b:2", "role": "prefill"},'
        ' {"url": "http://c:3", "role": "decode"}]}',
        roles=True,
    )
    assert {url: d.role for url, d in parsed.items()} == {
        "http://a:1": None,
        "http://b:2": "prefill",
        "http://c:3": "decode",
    }


@pytest.mark.parametrize(
    ("text", "roles", "message"),
    [
        ("", False, "expected a list"),
        ("[]", False, "lists no worker"),
        ("workers: []\n", False, "lists no worker"),
        ("- http://a:1\n- http://a:1/\n", False, "listed twice"),
        ("- ftp://a:1\n", False, "base URL"),
        ("- http://a:1/v1\n", False, "base URL"),
        ("- http://a:99999\n", False, "not a valid URL"),
        ("- http://10.0.0\n", False, "four numbers"),  # a file cut short mid-write
        ("- http://127\n", False, "four numbers"),
        ("- http://10.0.0.256:80\n", False, "four numbers"),
        ("- http://010.0.0.1:80\n", False, "four numbers"),  # octal to a resolver: 8.0.0.1
        ("- http://0x7f.1:80\n", False, "four numbers"),  # hexadecimal: 127.0.0.1
        ("- 7\n", False, "URL string"),
        ("- {url: http://a:1, role: prefill}\n", False, "all mixed"),
        ("- {url: http://a:1, role: leader}\n", True, "prefill or decode"),
        ("- {url: http://a:1, weight: 3}\n", True, "unknown key"),
        ("workers: [http://a:1]\nextra: 1\n", False, "expected a list"),
        ("- [unclosed\n", False, "not valid YAML"),
        ("a: 1\na: 2\n", False, "duplicate key"),
        ("- http://user:pw@a:1\n", False, "must not carry credentials"),  # never echoed
    ],
)
def test_what_a_file_may_not_say(text: str, roles: bool, message: str) -> None:
    with pytest.raises(WorkersFileError, match=message) as refused:
        parse_workers(text, roles=roles)
    assert "pw" not in str(refused.value)


def test_at_most_max_workers() -> None:
    many = "".join(f"- http://10.0.{i // 250}.{i % 250}:8000\n" for i in range(MAX_WORKERS + 1))
    with pytest.raises(WorkersFileError, match="at most"):
        parse_workers(many, roles=False)


class _Sink:
    def __init__(self) -> None:
        self.current: frozenset[str] = frozenset()
        self.snapshots: list[frozenset[str]] = []
        self.errors: list[str] = []

    def publish(self, workers: Mapping[str, WorkerDetails]) -> WorkerSetChange:
        change = diff_workers(self.current, frozenset(workers))
        self.current = frozenset(workers)
        self.snapshots.append(self.current)
        return change

    def record_error(self, reason: str, message: str, *, lasting: bool = False) -> None:
        self.errors.append(f"{reason}: {message}")

    def record_resync(self) -> None:
        raise AssertionError("a file is never re-listed")


def _write(path: Path, text: str) -> None:
    """Replace the file whole, as a deploy tool or a ConfigMap update does (a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_following_the_file_and_keeping_the_last_set_through_bad_versions(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    _write(path, "- http://a:1\n")
    source = FileWorkers(str(path), refresh_s=0.02)
    await source.prepare()
    sink = _Sink()
    task = asyncio.create_task(source.run(sink))
    try:
        await wait_until(lambda: sink.current == {"http://a:1"}, what="the first set")
        _write(path, "- http://a:1\n- http://b:2\n")
        await wait_until(lambda: sink.current == {"http://a:1", "http://b:2"}, what="b added")
        _write(path, "")  # half-written: the set stays, the error is counted once
        await wait_until(lambda: len(sink.errors) == 1, what="one error")
        path.unlink()  # gone: kept again, counted once more, and only once however long
        await wait_until(lambda: len(sink.errors) == 2, what="the missing file counted")
        polls = source.polls
        await wait_until(lambda: source.polls >= polls + 5, what="five more polls")
        assert len(sink.errors) == 2
        _write(path, "- http://b:2\n")
        await wait_until(lambda: sink.current == {"http://b:2"}, what="a removed")
        assert len(sink.errors) == 2 and "keeping the last set" in sink.errors[0]
        assert all(s for s in sink.snapshots)  # never an empty set
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class _InPlaceWriter:
    """Rewrites a file in place, as a shell's `>` or an editor saving in place does, but slowly:
    truncates it and writes `first`, then holds until `go` before it writes `rest`."""

    def __init__(self, path: Path, first: str, rest: str) -> None:
        self.path, self.first, self.rest = path, first, rest
        self.first_written, self.go, self.done = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with open(self.path, "w") as f:  # O_TRUNC: the same inode, emptied
            f.write(self.first)
            f.flush()
            self.first_written.set()
            if self.go.wait(timeout=30):
                f.write(self.rest)
        self.done.set()

    def stop(self) -> None:
        self.go.set()
        self._thread.join(timeout=5)


class _Clock:
    """The real monotonic clock, moved forward by the test: a version seen unchanged ages at once."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


async def _following(source: FileWorkers, first: set[str]) -> tuple[_Sink, asyncio.Task[None]]:
    await source.prepare()
    sink = _Sink()
    task = asyncio.create_task(source.run(sink))
    await wait_until(lambda: sink.current == first, what="the first set")
    return sink, task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_file_rewritten_in_place_is_read_only_once_its_writer_is_done(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    _write(path, "- http://c:3\n")
    inode = path.stat().st_ino
    clock = _Clock()
    source = FileWorkers(str(path), refresh_s=0.02, settle_s=30, monotonic_s=clock)
    sink, task = await _following(source, {"http://c:3"})
    writer = _InPlaceWriter(path, "- http://a:1\n", "- http://b:2\n")
    try:
        # Its first half is a valid list: a watcher that read it would drop c and b for a while.
        await wait_until(writer.first_written.is_set, what="the first half written")
        assert path.stat().st_ino == inode and path.read_text() == "- http://a:1\n"
        polls = source.polls
        await wait_until(lambda: source.polls >= polls + 5, what="five checks of the half file")
        assert sink.current == {"http://c:3"}
        writer.go.set()
        await wait_until(writer.done.is_set, what="the writer done")
        polls = source.polls
        await wait_until(lambda: source.polls >= polls + 5, what="five checks of the whole file")
        assert sink.current == {"http://c:3"}  # whole, but written within settle_s: it may go on
        clock.offset_s = 31.0  # settle_s has passed without a write
        await wait_until(lambda: sink.current == {"http://a:1", "http://b:2"}, what="the whole file")
        assert sink.snapshots == [{"http://c:3"}, {"http://a:1", "http://b:2"}]
        assert not sink.errors and source.moved_reads == 0
    finally:
        writer.stop()
        await _stop(task)


async def test_a_modification_time_in_the_past_does_not_shorten_the_settle(tmp_path: Path) -> None:
    """On NFS the modification time is the server's clock, which may run behind ours, and some
    file systems keep it to the second: a write just made may look an hour old. It still waits
    until this process has seen it unchanged for settle_s."""
    path = tmp_path / "workers.yaml"
    _write(path, "- http://c:3\n")
    clock = _Clock()
    source = FileWorkers(str(path), refresh_s=0.02, settle_s=30, monotonic_s=clock)
    sink, task = await _following(source, {"http://c:3"})
    try:
        inode = path.stat().st_ino
        path.write_text("- http://a:1\n")  # in place: the first half of a longer rewrite
        hour_ago_ns = time.time_ns() - 3600 * 10**9
        os.utime(path, ns=(hour_ago_ns, hour_ago_ns))
        assert path.stat().st_ino == inode
        polls = source.polls
        await wait_until(lambda: source.polls >= polls + 5, what="five checks of the changed file")
        assert sink.current == {"http://c:3"}
        clock.offset_s = 31.0  # seen unchanged for settle_s
        await wait_until(lambda: sink.current == {"http://a:1"}, what="the settled file")
        assert not sink.errors
    finally:
        await _stop(task)


async def test_a_rewrite_in_place_settles_by_the_real_clock(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    _write(path, "- http://c:3\n")
    source = FileWorkers(str(path), refresh_s=0.02)
    assert source.settle_s == settle_time_s(0.02) == 0.01
    assert settle_time_s(2.0) == 1.0 and settle_time_s(60.0) == 1.0
    sink, task = await _following(source, {"http://c:3"})
    try:
        inode = path.stat().st_ino
        path.write_text("- http://a:1\n- http://b:2\n")
        assert path.stat().st_ino == inode
        await wait_until(lambda: sink.current == {"http://a:1", "http://b:2"}, what="the new set")
        assert not sink.errors
    finally:
        await _stop(task)


async def test_a_file_renamed_in_or_swapped_by_a_symlink_is_read_at_once(tmp_path: Path) -> None:
    """A settle time far longer than the test's timeout: what is applied was applied unsettled."""
    # The layout of a Kubernetes ConfigMap volume: the file is a link through `..data`, a link
    # to a timestamped folder; an update writes a new folder and renames a new `..data` over it.
    for version, text in (("v1", "- http://c:3\n"), ("v2", "- http://d:4\n")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "workers.yaml").write_text(text)
    (tmp_path / "..data").symlink_to("v1")
    path = tmp_path / "workers.yaml"
    path.symlink_to("..data/workers.yaml")
    source = FileWorkers(str(path), refresh_s=0.02, settle_s=300)
    sink, task = await _following(source, {"http://c:3"})
    try:
        (tmp_path / "..data_tmp").symlink_to("v2")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        await wait_until(lambda: sink.current == {"http://d:4"}, what="the swapped ConfigMap")
        _write(path, "- http://a:1\n- http://b:2\n")  # written elsewhere, renamed over the link
        await wait_until(lambda: sink.current == {"http://a:1", "http://b:2"}, what="the renamed file")
        # A new file is empty between its creation and its first write: it settles first.
        _write(path, "")
        polls = source.polls
        await wait_until(lambda: source.polls >= polls + 5, what="five checks of the empty file")
        assert sink.current == {"http://a:1", "http://b:2"} and not sink.errors
        path.write_text("- http://e:5\n")  # its first write: no longer empty, and a new file
        await wait_until(lambda: sink.current == {"http://e:5"}, what="the new file written")
        assert not sink.errors
    finally:
        await _stop(task)


async def test_a_read_that_a_writer_overtakes_is_thrown_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "workers.yaml"
    _write(path, "- http://c:3\n")
    source = FileWorkers(str(path), refresh_s=0.02, settle_s=0)
    sink, task = await _following(source, {"http://c:3"})
    read_bytes = file_discovery._read_bytes
    appended = threading.Event()

    def read_while_a_writer_appends(f: BinaryIO) -> bytes:
        data = read_bytes(f)
        if not appended.is_set():  # the rest lands just after the first half was read
            with open(path, "a") as w:
                w.write("- http://b:2\n")
            appended.set()
        return data

    monkeypatch.setattr(file_discovery, "_read_bytes", read_while_a_writer_appends)
    try:
        _write(path, "- http://a:1\n")
        await wait_until(lambda: sink.current == {"http://a:1", "http://b:2"}, what="the whole file")
        assert appended.is_set() and source.moved_reads == 1
        assert sink.snapshots == [{"http://c:3"}, {"http://a:1", "http://b:2"}]
        assert not sink.errors
    finally:
        await _stop(task)


async def test_a_missing_or_invalid_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await FileWorkers(str(tmp_path / "none.yaml")).prepare()
    (tmp_path / "bad.yaml").write_text("- http://a:1/path\n")
    with pytest.raises(WorkersFileError, match="base URL"):
        await FileWorkers(str(tmp_path / "bad.yaml")).prepare()


TENANTS = 'tenants: [{name: t, api_key_hashes: ["hmac-sha256:' + "0" * 64 + '"]}]\n'


def test_the_config_takes_one_source_and_a_path_relative_to_itself(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text(TENANTS + "pools: [{name: p, models: [m], workers_file: {path: w.yaml}}]\n")
    pool = load_config(config).pools[0]
    assert pool.workers_file is not None and pool.workers_file.path == str(tmp_path / "w.yaml")
    config.write_text(
        TENANTS + "pools: [{name: p, models: [m], workers: [http://a:1], workers_file: {path: w.yaml}}]\n"
    )
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(config)


def test_every_relative_path_of_the_config_is_resolved_against_its_folder(tmp_path: Path) -> None:
    config = tmp_path / "gw.yaml"
    config.write_text(
        TENANTS
        + "policy_file: p.yaml\n"
        + "secrets: {key_hash_secret_file: s/secret}\n"
        + "decision_log: {path: logs/decisions.jsonl}\n"
        + "sync: {url: 'nats://127.0.0.1:4222', auth: {token_file: s/token}, tls: {ca_file: s/ca.pem}}\n"
        + "pools:\n"
        + "  - {name: a, models: [m], workers_file: {path: w.yaml}, worker_api_key_file: /abs/key,\n"
        + "     normalizer: {mode: tokenizer, tokenizer_dir: tok}}\n"
        + "  - {name: b, models: [n], kubernetes: {selector: app=x, port: 80, namespace: ns,\n"
        + "     api_server: 'https://k:6443', token_file: k/token, ca_file: k/ca.crt}}\n"
    )
    loaded = load_config(config)
    here = str(tmp_path)
    assert loaded.policy_file == f"{here}/p.yaml"
    assert loaded.secrets.key_hash_secret_file == f"{here}/s/secret"
    assert loaded.decision_log.path == f"{here}/logs/decisions.jsonl"
    assert loaded.sync.auth.token_file == f"{here}/s/token"
    assert loaded.sync.tls is not None and loaded.sync.tls.ca_file == f"{here}/s/ca.pem"
    a, b = loaded.pools
    assert a.workers_file is not None and a.workers_file.path == f"{here}/w.yaml"
    assert a.worker_api_key_file == "/abs/key"  # absolute: as written
    assert a.normalizer is not None and a.normalizer.tokenizer_dir == f"{here}/tok"
    assert b.kubernetes is not None and b.kubernetes.token_file == f"{here}/k/token"
    assert b.kubernetes.ca_file == f"{here}/k/ca.crt"
