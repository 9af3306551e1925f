"""Kubernetes discovery when its watch fails, against the fake API server: a watch that failed
without losing anything (a dropped connection, 429, 5xx, a watch gone silent or ended by the
server) resumes from the last version seen, within its backoff and `Retry-After`; every other
failure, or failing again and again, ends in a re-list that catches up with what was missed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.k8s.source import MAX_WATCH_RETRIES
from tests.gateway.fake_kube_api import FakeKubeApi, make_pod
from tests.gateway.k8s_follow import follow, url
from tests.support.wait import wait_until


async def test_an_expired_watch_relists_and_catches_up_with_missed_changes(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.put(make_pod("a", port=8001))
    fake.put(make_pod("b", port=8002))
    async with follow(fake, tmp_path) as f:
        await f.routed(8001, 8002)
        await wait_until(lambda: bool(fake.watchers))
        # Changes the watch never reports, then a compaction: only a fresh list can see them.
        fake.change_silently([make_pod("b", port=8002), make_pod("c", port=8003)])
        fake.expire()
        await f.routed(8002, 8003)
        assert "expired" in f.errors and f.resyncs == 1 and fake.lists == 2
        assert f.discovery.status().resyncs == 1
        fake.put(make_pod("d", port=8004))  # and the new watch follows on
        await f.routed(8002, 8003, 8004)


@pytest.mark.parametrize("failure", ["not_json", "too_long", "unauthorized", "forbidden_event"])
async def test_a_watch_failure_that_may_have_lost_events_resyncs(
    fake: FakeKubeApi, tmp_path: Path, failure: str
) -> None:
    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path, max_event_bytes=64 * 1024) as f:
        await wait_until(lambda: bool(fake.watchers))
        seen = fake.version
        fake.change_silently([make_pod("b", port=8002)])
        if failure == "not_json":
            fake.send_raw(b"<html>proxy error</html>\n")
        elif failure == "too_long":
            fake.send_raw(b'{"type": "ADDED", "object": {"x": "' + b"x" * 100_000)
        elif failure == "unauthorized":  # the token was rotated: refused until the file is read again
            fake.token = "tok-2"
            (tmp_path / "token").write_text("tok-2")
            fake.end_watches()
        else:
            fake.send_error(403, "Forbidden", "the Role was edited")
        await f.routed(8002)
        assert f.errors == ["watch"] and fake.lists == 2 and f.resyncs == 1
        # The list asked for a snapshot no older than what the watch had seen (the watch cache may
        # serve it), not for a quorum read.
        assert fake.list_versions == [None, str(seen)]
        assert failure != "unauthorized" or fake.unauthorized >= 1


@pytest.mark.parametrize("failure", ["dropped", "error_event", "unavailable", "refused"])
async def test_a_watch_that_lost_nothing_resumes_from_the_last_version_without_a_list(
    fake: FakeKubeApi, tmp_path: Path, failure: str
) -> None:
    """A dropped connection, a 5xx (as an ERROR event or an HTTP answer), a refused connection:
    the next watch starts where the last one was, and the events it missed are replayed."""
    up = asyncio.Event()  # the watcher's backoff lasts while the API server is down
    up.set()

    async def sleep(delay_s: float) -> None:
        await up.wait()

    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path, sleep=sleep) as f:
        await wait_until(lambda: bool(fake.watchers))
        seen = fake.version
        if failure == "dropped":
            fake.drop_watches()
        elif failure == "error_event":
            fake.send_error(500, "InternalError", "etcd is unhappy")
        elif failure == "unavailable":
            fake.fail_watches(2, 503, "ServiceUnavailable")
            fake.end_watches()
        else:  # the API server restarts: connections refused for a while
            port = fake.port
            up.clear()
            await fake.stop()
            await wait_until(lambda: "watch" in f.errors)
            await fake.start(port)
            up.set()
        fake.put(make_pod("b", port=8002))  # while no watch is open, or before the next one opens
        await f.routed(8001, 8002)
        assert fake.lists == 1 and f.resyncs == 0 and set(f.errors) == {"watch"}
        assert set(fake.watch_versions[1:]) == {str(seen)}
        fake.delete("a")  # and the watch follows on
        await f.routed(8002)


async def test_a_429_is_retried_after_its_retry_after_bounded_by_the_longest_backoff(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    waits: list[float] = []

    async def sleep(delay_s: float) -> None:
        waits.append(delay_s)  # the wait the watcher chose; the test does not take it

    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path, backoff_initial_s=0.02, backoff_max_s=5.0, sleep=sleep) as f:
        await wait_until(lambda: bool(fake.watchers))
        seen = fake.version
        fake.fail_watches(1, 429, "TooManyRequests", retry_after_s=3)
        fake.fail_watches(1, 429, "TooManyRequests", retry_after_s=3600)
        fake.end_watches()
        await wait_until(lambda: fake.watches == 4 and bool(fake.watchers))
        fake.put(make_pod("b", port=8002))
        await f.routed(8001, 8002)
        assert fake.lists == 1 and f.errors == ["watch", "watch"]
        assert fake.watch_versions[1:] == [str(seen)] * 3
        assert 3.0 in waits and 5.0 in waits and max(waits) == 5.0


@pytest.mark.parametrize(
    ("retry_after", "wait_s"),
    [
        ("\u00b2", None),
        ("9" * 400, 5.0),
        ("9" * 5000, 5.0),
        ("12345678901", 5.0),
        (" 4 ", 4.0),
        ("0" * 12 + "3", 3.0),
    ],
    ids=["superscript-two", "400-digits", "5000-digits", "11-digits", "spaced", "leading-zeros"],
)
async def test_a_429_with_an_odd_retry_after_still_resumes_the_watch(
    fake: FakeKubeApi, tmp_path: Path, retry_after: str, wait_s: float | None
) -> None:
    waits: list[float] = []

    async def sleep(delay_s: float) -> None:
        waits.append(delay_s)

    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path, backoff_initial_s=0.02, backoff_max_s=5.0, sleep=sleep) as f:
        await wait_until(lambda: bool(fake.watchers))
        seen = fake.version
        fake.fail_watches(1, 429, "TooManyRequests", retry_after_s=retry_after)
        fake.end_watches()
        await wait_until(lambda: fake.watches == 3 and bool(fake.watchers))
        fake.put(make_pod("b", port=8002))
        await f.routed(8001, 8002)
        assert fake.lists == 1 and f.errors == ["watch"]  # resumed, not the bug path's relist
        assert fake.watch_versions[1:] == [str(seen)] * 2
        if wait_s is None:
            assert max(waits) < 1.0  # no Retry-After: the backoff alone (0.02 s, doubled)
        else:
            assert wait_s in waits and max(waits) == wait_s


async def test_a_watch_failing_again_and_again_ends_in_a_list(fake: FakeKubeApi, tmp_path: Path) -> None:
    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path) as f:
        await wait_until(lambda: bool(fake.watchers))
        fake.change_silently([make_pod("b", port=8002)])
        fake.fail_watches(MAX_WATCH_RETRIES + 1, 503, "ServiceUnavailable")
        fake.end_watches()
        await f.routed(8002)
        assert fake.lists == 2 and f.resyncs == 1 and f.errors == ["watch"] * (MAX_WATCH_RETRIES + 1)


async def test_a_list_from_the_watch_cache_that_fails_is_retried_from_the_latest(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path) as f:
        await wait_until(lambda: bool(fake.watchers))
        seen = fake.version
        fake.list_error = (504, "Timeout")  # as for "Too large resource version"
        fake.expire()
        await wait_until(lambda: fake.lists >= 2)
        fake.list_error = None
        fake.put(make_pod("b", port=8002))
        await f.routed(8001, 8002)
        assert fake.list_versions[:2] == [None, str(seen)] and set(fake.list_versions[2:]) == {None}


async def test_a_watch_gone_silent_is_given_up_and_opened_again(fake: FakeKubeApi, tmp_path: Path) -> None:
    """A link whose far end vanished without a reset carries nothing, not even the bookmark a real
    API server sends about every minute: the watch is given up after `watch_silence_s` of it, and
    a new one starts from the last version seen."""
    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path, watch_silence_s=1.0) as f:
        await wait_until(lambda: bool(fake.watchers))
        fake.stall_watches()
        fake.put(make_pod("b", port=8002))  # the stalled watch never sends it
        await f.routed(8001, 8002)
        assert f.errors == ["watch"] and fake.lists == 1 and fake.watches == 2


async def test_a_watch_the_server_ends_resumes_from_the_last_version_without_a_list(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.put(make_pod("a", port=8001))
    async with follow(fake, tmp_path) as f:
        await wait_until(lambda: bool(fake.watchers))
        fake.put(make_pod("b", port=8002))
        await f.routed(8001, 8002)
        fake.end_watches()
        await wait_until(lambda: fake.watches == 2 and bool(fake.watchers))
        fake.delete("a")
        await f.routed(8002)
        assert fake.lists == 1 and f.errors == [] and f.resyncs == 0


async def test_a_server_that_ends_every_watch_at_once_is_not_hammered(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    """Bookmarks or not: a watch that lasts under a second is not a server's timeoutSeconds."""
    fake.put(make_pod("a", port=8001))
    fake.bookmark_every_s = 0.001  # each watch delivers a bookmark, then ends
    fake.max_watch_s = 0.005
    async with follow(fake, tmp_path, backoff_initial_s=0.2, backoff_max_s=0.2) as f:
        first = fake.watches
        opened_s = time.monotonic()
        await wait_until(lambda: fake.watches >= first + 6)
        assert time.monotonic() - opened_s >= 5 * 0.1  # each wait at least half the backoff
        assert f.current == {url(8001)} and fake.lists == 1 and f.errors == []
