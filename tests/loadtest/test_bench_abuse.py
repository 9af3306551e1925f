"""`kvgate bench abuse`: a few cheap probes against a real stack, run as a user runs the command,
the verdict machinery on its own (a failing or overrunning probe fails the run), and what the
connection probes read: answers split from a connection's bytes, connections a server holds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest.abuse.observe import held_connections
from loadtest.abuse.probe import Observation, Probe, run_probe
from loadtest.abuse.probes_connections import Answers, parse_answers
from loadtest.abuse.report import Verdict, table
from loadtest.abuse.settings import QUICK
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
CHEAP = (
    "deep_json",
    "tiny_prompt",
    "trailing_slash",
    "metrics_port",
    "pipelined",
    "address_limit",
    "garbage_worker",
)


def _bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway.cli", "bench", "abuse", *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench stops its gateway and workers on SIGTERM
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"bench abuse overran {timeout_s} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_cheap_probes_pass_against_a_real_stack_and_print_the_table() -> None:
    done = _bench("--quick", "--only", ",".join(CHEAP))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| probe | expected | observed | ok |"
    by_probe = {row.split(" | ")[0].removeprefix("| "): row for row in rows[1:]}
    assert sorted(by_probe) == sorted(CHEAP)
    assert all(row.endswith("| yes |") for row in by_probe.values())
    assert "| 400 invalid_request |" in by_probe["deep_json"]
    assert "| 404, no Location |" in by_probe["trailing_slash"]
    assert "502 bad_gateway, 502 bad_gateway" in by_probe["garbage_worker"]
    n = QUICK.pipeline_connections
    assert f"{n}/{n} closed by the server (0 by a reset)" in by_probe["pipelined"]
    assert f"answers per connection 17×{n} " in by_probe["pipelined"]
    assert f"pipelined_requests +{n};" in by_probe["pipelined"]
    extra = QUICK.address_extra_connections
    assert f"{extra}/{extra} more closed unanswered" in by_probe["address_limit"]
    assert f"address_limit +{extra};" in by_probe["address_limit"]
    assert "the gateway held none of them" in by_probe["address_limit"]


def test_an_unknown_probe_is_refused_before_anything_starts() -> None:
    done = _bench("--only", "deep_json,nosuch", timeout_s=30)
    assert done.returncode == 2
    assert "unknown probe nosuch" in done.stderr and "trailing_slash" in done.stderr


def _probe(run: Observation | Exception | None) -> Probe:
    async def body(ctx: object) -> Observation:
        if isinstance(run, Exception):
            raise run
        if run is None:
            await asyncio.sleep(10)  # overruns its limit
        assert isinstance(run, Observation)
        return run

    return Probe("p", lambda s: "expected", body, lambda s: 0.05)


@pytest.mark.parametrize(
    ("outcome", "observed", "ok"),
    [
        (Observation("fine", True), "fine", True),
        (Observation("off", False), "off", False),
        (RuntimeError("boom"), "probe error: RuntimeError: boom", False),
        (None, "did not finish within its limit of 0 s", False),
    ],
)
def test_a_probe_that_fails_raises_or_overruns_is_a_failed_verdict(
    outcome: Observation | Exception | None, observed: str, ok: bool
) -> None:
    ctx = SimpleNamespace(sizes=QUICK)  # all a probe runner reads of its context
    verdict = asyncio.run(run_probe(_probe(outcome), ctx))  # type: ignore[arg-type]
    assert (verdict.probe, verdict.expected, verdict.observed, verdict.ok) == ("p", "expected", observed, ok)


def test_the_table_marks_failures_and_keeps_cells_apart() -> None:
    text = table([Verdict("a", "x | y", "seen", True), Verdict("b", "x", "not seen", False)])
    assert text.splitlines() == [
        "| probe | expected | observed | ok |",
        "|---|---|---|---|",
        "| a | x / y | seen | yes |",
        "| b | x | not seen | **NO** |",
    ]


def _answer(status: int, body: bytes, *fields: bytes) -> bytes:
    head = [b"HTTP/1.1 %d X" % status, b"Content-Length: %d" % len(body), *fields]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def test_answers_are_split_by_their_lengths_and_a_cut_one_is_left_over() -> None:
    closing = _answer(503, b"x", b"Connection: close")
    data = _answer(200, b"HTTP/1.1 200") + _answer(200, b"{}") + closing
    assert parse_answers(data) == Answers((200, 200, 503), True, 0)
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc"
    assert parse_answers(data + cut) == Answers((200, 200, 503), True, len(cut))
    assert parse_answers(data[:-1]) == Answers((200, 200), False, len(closing) - 1)
    assert parse_answers(b"") == Answers((), False, 0)


async def test_held_connections_counts_by_client_address_what_the_server_has_not_closed() -> None:
    accepted: list[asyncio.StreamWriter] = []
    ended: list[asyncio.StreamWriter] = []  # their client closed; the server has not

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()
        ended.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = [
        await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)) for _ in range(3)
    ]
    try:
        await wait_until(lambda: len(accepted) == 3)
        assert held_connections(port, "127.0.0.2") == 3
        assert held_connections(port, "127.0.0.1") == 0
        for _, writer in clients:
            writer.close()
        await wait_until(lambda: len(ended) == 3)
        assert held_connections(port, "127.0.0.2") == 3
        for writer in accepted:
            writer.close()
        await wait_until(lambda: held_connections(port, "127.0.0.2") == 0)
    finally:
        for writer in accepted:
            writer.close()
        for _, writer in clients:
            writer.close()
        server.close()
        await server.wait_closed()
