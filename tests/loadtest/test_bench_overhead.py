"""The overhead benchmark's parts on real processes: static backend, pass-through proxy, CPU, workload."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import bench_overhead, overhead_report, static_backend
from loadtest.overhead_load import LoadResult, chat_bodies, tree_cpu_s
from loadtest.overhead_runner import TargetResult, cpu_ratio
from tests.support.processes import free_port, started


@pytest.fixture
def backend() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = started([sys.executable, "-m", "loadtest.static_backend", "--port", str(port)], url + "/health")
    try:
        yield url
    finally:
        proc.stop()
    assert proc.popen.poll() is not None


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, json.loads(resp.read())


@pytest.mark.e2e
def test_static_backend_answers_chat_and_unknown_paths(backend: str) -> None:
    status, body = post(backend + "/v1/chat/completions", b'{"model":"bench-model","messages":[]}')
    assert status == 200 and body["object"] == "chat.completion"
    with pytest.raises(urllib.error.HTTPError) as err:
        post(backend + "/v1/nope", b"{}")
    assert err.value.code == 404


@pytest.mark.e2e
def test_pass_through_proxy_and_process_cpu(backend: str) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.overhead_load", "--child-proxy", "aiohttp"]
    proc = started([*argv, "--port", str(port), "--upstream", backend], f"http://127.0.0.1:{port}/health")
    try:
        status, body = post(f"http://127.0.0.1:{port}/v1/chat/completions", chat_bodies(0)[0].encode())
        assert status == 200 and body["model"] == "bench-model"
        assert tree_cpu_s(proc.popen.pid) > 0  # the interpreter start alone costs CPU
    finally:
        proc.stop()


def test_workload_is_seeded() -> None:
    a, b, c = chat_bodies(1), chat_bodies(1), chat_bodies(2)
    assert a == b and a != c and len(a) == 64
    assert len({json.loads(x)["messages"][0]["content"] for x in a}) == 8


@pytest.mark.e2e
def test_bench_command_end_to_end_with_builtin_tools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench_overhead.add_arguments(parser)
    out_json = tmp_path / "r.json"
    argv = [
        "--duration",
        "1",
        "--warmup",
        "0",
        "--concurrency",
        "4,1",
        "--targets",
        "direct",
        "--repeats",
        "2",
    ]
    argv += ["--backend", "builtin", "--load-tool", "builtin", "--json", str(out_json)]
    args = parser.parse_args(argv)
    assert bench_overhead.run(args) == 0
    printed = capsys.readouterr().out
    assert "| direct |" in printed and "built-in static backend" in printed
    result = json.loads(out_json.read_text())["results"][0]
    assert result["missing"] is None and [r["concurrency"] for r in result["runs"]] == [4, 1, 4, 1]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in result["runs"])


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_overhead.add_arguments(parser)
    assert bench_overhead.run(parser.parse_args(["--targets", "direct,bogus"])) == 2
    assert bench_overhead.run(parser.parse_args(["--concurrency", "0"])) == 2
    assert bench_overhead.run(parser.parse_args(["--repeats", "0"])) == 2
    assert "bogus" in capsys.readouterr().err


def test_repeats_are_combined_by_median() -> None:
    r = TargetResult("t", None)
    for rps, cpu in ((100.0, 50.0), (300.0, 10.0), (200.0, 30.0)):
        r.runs.append(LoadResult(1, 10, 1, 1.0, rps, rps / 100, rps / 10, cpu))
    combined = r.at(1)
    assert combined is not None
    assert (combined.rps, combined.p50_ms, combined.cpu_us_per_request) == (200.0, 2.0, 30.0)
    assert (combined.requests, combined.errors) == (30, 3)
    assert r.at(32) is None


def test_cpu_ratio_pairs_rounds() -> None:
    def runs(*cpu: float) -> list[LoadResult]:
        return [LoadResult(32, 100, 0, 1.0, 100.0, 1.0, 2.0, c) for c in cpu]

    mine = TargetResult("kvgate cost", "peer", runs(200, 260, 180))
    peer = TargetResult("peer", None, runs(100, 130, 120))
    # Same-round ratios 2.0, 2.0, 1.5: median 2.0 (the ratio of the medians would be 200/120).
    assert cpu_ratio(mine, peer, 32) == 2.0
    assert mine.cpu_rounds(32) == [200, 260, 180]
    row = overhead_report._row(mine, {"peer": peer, "kvgate cost": mine}, 32, 1)
    assert "| 200, 260, 180 | 2.00x peer |" in row


@pytest.mark.e2e
def test_streamed_bodies_and_the_backends_event_stream() -> None:
    body = json.loads(chat_bodies(0, stream=True)[0])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "stream" not in json.loads(chat_bodies(0)[0])
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.static_backend", "--port", str(port), "--stream"]
    url = f"http://127.0.0.1:{port}"
    proc = started(argv, url + "/health")
    try:
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.headers["content-type"] == "text/event-stream"
            events = [e for e in resp.read().decode().split("\n\n") if e]
    finally:
        proc.stop()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.split() == [f"t{i}" for i in range(static_backend.STREAM_DELTAS)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
