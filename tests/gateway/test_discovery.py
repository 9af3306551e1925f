"""Worker discovery: static lists, DNS re-resolution with an injected resolver, and the real getaddrinfo."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.discovery import Discovery, WorkerSetChange, diff_workers
from gateway.worker_sources import DnsWorkers, StaticWorkers, resolve_with_loop, worker_url
from tests.support.wait import wait_until


class ScriptedResolver:
    """Answers from a script, one entry per call; an exception entry is raised."""

    def __init__(self, *answers: list[str] | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_urls_and_diff() -> None:
    assert worker_url("http", "10.0.0.7", 8000) == "http://10.0.0.7:8000"
    assert worker_url("https", "fd00::7", 8000) == "https://[fd00::7]:8000"
    change = diff_workers(frozenset({"a", "b"}), frozenset({"b", "c"}))
    assert change.added == {"c"} and change.removed == {"a"} and change.current == {"b", "c"}
    assert not diff_workers(frozenset({"a"}), frozenset({"a"}))


async def test_static_list_is_reported_once() -> None:
    d = Discovery(StaticWorkers(["http://127.0.0.1:1/", "http://127.0.0.1:2"]))
    changes = [c async for c in d.watch()]
    assert len(changes) == 1 and changes[0].added == {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    with pytest.raises(ValueError, match="http://"):
        StaticWorkers(["127.0.0.1:1"])


async def test_dns_changes_failures_and_empty_answers() -> None:
    r = ScriptedResolver(
        ["10.0.0.1", "10.0.0.2"],
        ["10.0.0.2", "10.0.0.3", "10.0.0.3"],
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        ["fd00::1"],
        [],
        [],
    )
    d = Discovery(DnsWorkers("vllm.llm.svc.cluster.local", 8000, resolver=r))
    c1 = await d.refresh()
    assert c1.added == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    c2 = await d.refresh()
    assert c2.added == {"http://10.0.0.3:8000"} and c2.removed == {"http://10.0.0.1:8000"}
    c3 = await d.refresh()  # DNS failure: nothing removed
    assert not c3 and d.current == {"http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    status = d.status()
    assert status.failures == 1 and status.last_error is not None and "gaierror" in status.last_error
    c4 = await d.refresh()
    assert c4.current == {"http://[fd00::1]:8000"} and d.status().last_error is None
    c5 = await d.refresh()  # a real answer with no pods: once is not yet enough
    assert not c5 and d.current == {"http://[fd00::1]:8000"}
    assert d.status().last_error == "no_addresses: no workers (1 of 2 answers in a row)"
    c6 = await d.refresh()  # twice in a row empties the pool
    assert c6.removed == {"http://[fd00::1]:8000"} and d.current == frozenset()
    assert d.status().last_error is None
    assert r.calls[0] == ("vllm.llm.svc.cluster.local", 8000)


NXDOMAIN = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
NODATA = socket.gaierror(socket.EAI_NODATA, "No address associated with hostname")
AGAIN = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
FAIL = socket.gaierror(socket.EAI_FAIL, "Non-recoverable failure in name resolution")


async def test_a_headless_service_scaled_to_zero_empties_the_pool() -> None:
    """Cluster DNS answers NXDOMAIN for a headless Service without ready pods: `getaddrinfo` raises
    EAI_NONAME. That is an answer (no such name), not a failure: at the second in a row the pool is
    empty, and failed lookups in between neither count nor reset the count."""
    errors: list[str] = []
    r = ScriptedResolver(["10.0.0.1", "10.0.0.2"], NXDOMAIN, AGAIN, NXDOMAIN, NXDOMAIN, ["10.0.0.9"])
    d = Discovery(DnsWorkers("vllm.llm.svc.cluster.local", 8000, resolver=r), on_error=errors.append)
    await d.refresh()
    assert not await d.refresh() and len(d.current) == 2  # NXDOMAIN once: kept
    assert not await d.refresh() and len(d.current) == 2  # a failure says nothing
    gone = await d.refresh()
    assert gone.removed == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"} and not d.current
    assert not await d.refresh() and not d.current  # still none: nothing to report
    assert errors == ["no_addresses", "resolve"]  # an empty pool answering NXDOMAIN is no error
    back = await d.refresh()  # scaled up again
    assert back.added == {"http://10.0.0.9:8000"}


@pytest.mark.parametrize("answer", [NXDOMAIN, NODATA], ids=["nxdomain", "nodata"])
async def test_one_negative_answer_between_answers_keeps_the_set(answer: socket.gaierror) -> None:
    r = ScriptedResolver(["10.0.0.1"], answer, ["10.0.0.1"], answer, ["10.0.0.1"])
    d = Discovery(DnsWorkers("svc", 8000, resolver=r))
    for _ in range(5):
        await d.refresh()
        assert d.current == {"http://10.0.0.1:8000"}  # a flap, twice, never two in a row
    assert d.status().failures == 2


async def test_failed_lookups_keep_the_set_however_many() -> None:
    r = ScriptedResolver(["10.0.0.1"], AGAIN, FAIL, socket.gaierror(socket.EAI_AGAIN, "x"), AGAIN)
    d = Discovery(DnsWorkers("svc", 8000, resolver=r))
    for _ in range(8):
        await d.refresh()
    assert d.current == {"http://10.0.0.1:8000"} and d.status().failures == 7


async def test_empty_after_one_answer_when_asked() -> None:
    d = Discovery(DnsWorkers("svc", 8000, resolver=ScriptedResolver(["10.0.0.1"], NODATA)), empty_after=1)
    await d.refresh()
    assert (await d.refresh()).removed == {"http://10.0.0.1:8000"}
    with pytest.raises(ValueError, match="empty_after"):
        Discovery(StaticWorkers([]), empty_after=0)


async def test_answers_of_no_addresses_must_span_empty_after_s() -> None:
    """A resolver caching a negative answer gives it at every lookup until its TTL ends: however
    many such answers come, the pool empties only once they span `empty_after_s`."""
    now_s = [0.0]
    r = ScriptedResolver(["10.0.0.1"], NXDOMAIN, ["10.0.0.1"], NXDOMAIN)
    d = Discovery(DnsWorkers("svc", 8000, resolver=r), empty_after_s=10.0, clock=lambda: now_s[0])
    await d.refresh()
    now_s[0] = 100.0
    await d.refresh()  # the first negative answer, then the workers again: the span starts over
    await d.refresh()
    for now_s[0] in (105.0, 105.1, 109.9, 114.9):  # five answers in a row, over 9.9 s
        assert not await d.refresh() and d.current == {"http://10.0.0.1:8000"}
    now_s[0] = 115.0
    assert (await d.refresh()).removed == {"http://10.0.0.1:8000"}
    with pytest.raises(ValueError, match="empty_after_s"):
        Discovery(StaticWorkers([]), empty_after_s=-1)


async def test_the_loops_getaddrinfo_errors_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real resolver path (`resolve_with_loop`): what the loop's `getaddrinfo` raises
    for a name with no addresses is an empty answer; a temporary failure is raised to `refresh`."""
    raised: list[OSError] = [NXDOMAIN]
    real = asyncio.get_running_loop().getaddrinfo

    async def getaddrinfo(host: str, port: int, **kw: object) -> object:
        if host != "vllm-headless.llm.svc.cluster.local":
            return await real(host, port, **kw)  # type: ignore[arg-type]
        raise raised[0]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    source = DnsWorkers("vllm-headless.llm.svc.cluster.local", 8000)
    assert await source.resolve() == frozenset()
    raised[0] = NODATA
    assert await source.resolve() == frozenset()
    raised[0] = AGAIN
    with pytest.raises(socket.gaierror):
        await source.resolve()


async def test_slow_resolver_times_out_and_big_answers_are_capped() -> None:
    async def slow(host: str, port: int) -> list[str]:
        await asyncio.sleep(10)
        return []

    d = Discovery(DnsWorkers("x", 80, resolver=slow, timeout_s=0.05))
    assert not await d.refresh() and d.status().failures == 1

    many = ScriptedResolver([f"10.0.{i // 256}.{i % 256}" for i in range(50)])
    capped = Discovery(DnsWorkers("x", 80, resolver=many, max_workers=8))
    assert len((await capped.refresh()).current) == 8


async def test_a_dual_stack_answer_counts_each_pod_once() -> None:
    """A headless Service with ipFamilyPolicy PreferDualStack or RequireDualStack answers an A and
    an AAAA record for every ready pod: two URLs for one engine would split its prefix cache in the
    index and double its in-flight cap. The family of the first address (the system's preference,
    RFC 6724) is kept."""
    both = ScriptedResolver(["fd00::1", "10.0.0.1", "fd00::2", "10.0.0.2"], ["10.0.0.1", "fd00::1"])
    d = Discovery(DnsWorkers("vllm.llm.svc.cluster.local", 8000, resolver=both))
    assert (await d.refresh()).current == {"http://[fd00::1]:8000", "http://[fd00::2]:8000"}
    assert (await d.refresh()).current == {"http://10.0.0.1:8000"}


def test_bad_dns_settings() -> None:
    with pytest.raises(ValueError, match="port"):
        DnsWorkers("x", 0)
    with pytest.raises(ValueError, match="scheme"):
        DnsWorkers("x", 80, scheme="tcp")
    with pytest.raises(ValueError, match="interval"):
        Discovery(StaticWorkers([]), interval_s=0)


async def test_real_getaddrinfo_on_loopback() -> None:
    assert await resolve_with_loop("127.0.0.1", 8000) == ["127.0.0.1"]
    assert "127.0.0.1" in await resolve_with_loop("localhost", 8000)
    d = Discovery(DnsWorkers("127.0.0.1", 8123))
    assert (await d.refresh()).added == {"http://127.0.0.1:8123"}


async def test_background_loop_reports_changes_until_stopped() -> None:
    r = ScriptedResolver(["10.0.0.1"], ["10.0.0.1"], ["10.0.0.2"], ["10.0.0.2"])
    d = Discovery(DnsWorkers("svc", 9000, resolver=r), interval_s=0.01)
    seen: list[WorkerSetChange] = []
    got_two = asyncio.Event()

    def on_change(change: WorkerSetChange) -> None:
        seen.append(change)
        if len(seen) == 2:
            got_two.set()

    first = await d.start(on_change)
    assert first.added == {"http://10.0.0.1:9000"}
    async with asyncio.timeout(5):
        await got_two.wait()
    await d.stop()
    calls = len(r.calls)
    # A second loop at the same interval is the clock: while it polls three times, the stopped one
    # had every chance to poll again.
    witness = ScriptedResolver(["10.0.0.9"])
    other = Discovery(DnsWorkers("svc", 9000, resolver=witness), interval_s=0.01)
    await other.start(lambda change: None)
    await wait_until(lambda: len(witness.calls) >= 3)
    await other.stop()
    assert len(r.calls) == calls
    assert seen[1].added == {"http://10.0.0.2:9000"} and seen[1].removed == {"http://10.0.0.1:9000"}
