"""The decision log's times: each decision's `wall_ts` is when it was made (not when its request
ended), and its `t_s` count from one origin per run, shared by the processes of
`kvgate serve --processes`."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from gateway.config.base import ConfigError
from gateway.decision_log import ORIGIN_ENV, DecisionLog
from gateway.multiproc import _shared_decision_log
from loadtest.replay.log import read_decisions, rebase
from policies.base import RouteDecision, RouteRequest, WorkerId, WorkerView

REQ = RouteRequest("r", "p", "t", "tenant:t", (), 10, 16)
VIEW = WorkerView(WorkerId("w"))


def _lines(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_each_decisions_wall_ts_is_when_it_was_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream's decision is stamped when the policy chose, not at the stream's end."""
    clock = [1_000.0]
    monkeypatch.setattr("gateway.decision_log.time.time", lambda: clock[0])
    log = DecisionLog(str(tmp_path / "d.jsonl"), max_records=10, environ={})
    log.decided("r", REQ, RouteDecision(WorkerId("w"), 0.0, "miss"), [VIEW], object(), 5.0)
    clock[0] = 1_030.0  # the first attempt failed 30 s in; the retry is decided now
    log.decided("r", REQ, RouteDecision(WorkerId("w"), 0.0, "miss"), [VIEW], object(), 35.0)
    clock[0] = 1_600.0  # the stream ends ten minutes later
    log.finished("r", None, REQ, status=200, prompt_tokens=10, cached_tokens=0, ttft_s=0.01)
    log.close()
    (line,) = _lines(tmp_path / "d.jsonl")
    decisions = line["decisions"]
    assert isinstance(decisions, list)
    assert [(d["t_s"], d["wall_ts"]) for d in decisions] == [(0.0, 1_000.0), (30.0, 1_030.0)]
    assert "wall_ts" not in line  # the record's only times are its decisions'


def _decide(log: DecisionLog, rid: str, now_s: float) -> None:
    log.decided(rid, REQ, RouteDecision(WorkerId("w"), 0.0, "miss"), [VIEW], object(), now_s)
    log.finished(rid, rid, REQ, status=200, prompt_tokens=10, cached_tokens=0, ttft_s=0.01)


def test_a_gateway_on_its_own_starts_a_new_file_and_keeps_the_last_runs(tmp_path: Path) -> None:
    """A restart does not continue the last run's lines, whose `t_s` counted from another origin,
    nor lose them: they are moved to `<path>.prev`, the evidence of the run that crashed."""
    path = tmp_path / "d.jsonl"
    prev = tmp_path / "d.jsonl.prev"
    for run, now_s in (("first", 100.0), ("second", 900.0), ("third", 1_500.0)):
        log = DecisionLog(str(path), max_records=10, environ={})
        _decide(log, run, now_s)
        log.close()
    assert [(line["client_request_id"], line["decisions"][0]["t_s"]) for line in _lines(path)] == [  # type: ignore[index]
        ("third", 0.0)
    ]
    assert [line["client_request_id"] for line in _lines(prev)] == ["second"]  # an older .prev replaced
    DecisionLog(str(path), max_records=10, environ={}).close()  # a run that logged nothing
    DecisionLog(str(path), max_records=10, environ={}).close()  # does not replace the last one's
    assert path.read_bytes() == b""
    assert [line["client_request_id"] for line in _lines(prev)] == ["third"]


def test_a_pipe_is_not_moved_aside(tmp_path: Path) -> None:
    fifo = tmp_path / "d.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = DecisionLog(str(fifo), max_records=10, environ={})
        _decide(log, "r", 1.0)
        log.close()
        assert orjson.loads(os.read(reader, 1 << 16))["client_request_id"] == "r"
        assert not (tmp_path / "d.fifo.prev").exists()
        # A process of `--processes` counts no lines in it (a read would wait for its writers).
        shared = DecisionLog(str(fifo), max_records=10, environ={ORIGIN_ENV: "1.0"})
        _decide(shared, "s", 2.0)
        shared.close()
        assert orjson.loads(os.read(reader, 1 << 16))["client_request_id"] == "s"
    finally:
        os.close(reader)


def test_the_processes_of_one_run_share_its_file_and_timeline(tmp_path: Path) -> None:
    """`kvgate serve --processes`: the supervisor starts the file afresh and hands every process
    the run's origin; a process it restarts continues the file on the same timeline, and
    `kvgate bench replay` reads one stream of decisions."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"stale": "a line of an earlier run"}\n')
    env = _shared_decision_log(path.name, tmp_path)
    origin_s = float(env[ORIGIN_ENV])
    one = DecisionLog(str(path), max_records=10, environ=env)
    two = DecisionLog(str(path), max_records=10, environ=env)
    _decide(two, "b", origin_s + 3.0)  # the second process decides first ...
    _decide(one, "a", origin_s + 1.0)  # ... of a request that arrived earlier at the first
    one.close()
    two.close()
    restarted = DecisionLog(str(path), max_records=10, environ=env)  # the first process, again
    _decide(restarted, "c", origin_s + 7.5)
    restarted.close()
    decisions, _ = read_decisions(path)
    assert {rid: d.t_s for rid, d in decisions.items()} == {"a": 1.0, "b": 3.0, "c": 7.5}
    assert rebase(decisions.values()) == 1.0
    assert "stale" not in path.read_text()
    assert "stale" in (tmp_path / "d.jsonl.prev").read_text()  # the last run's, moved aside


def test_processes_restarted_in_a_crash_loop_keep_the_file_bounded(tmp_path: Path) -> None:
    """Under `--processes N` a process writes `max_records` less what the file held when it
    opened it: its restarts only fill what their predecessors left, so the file never holds more
    than N x `max_records` lines, however often they restart."""
    path = tmp_path / "d.jsonl"
    env = _shared_decision_log(path.name, tmp_path)
    origin_s = float(env[ORIGIN_ENV])
    other = DecisionLog(str(path), max_records=3, environ=env)  # the second process, alive throughout
    for restart in range(10):  # the first process, restarted again and again
        one = DecisionLog(str(path), max_records=3, environ=env)
        for i in range(2):
            _decide(one, f"one-{restart}-{i}", origin_s + restart)
        one.close()
        assert one.written + one.dropped == 2
    for i in range(5):
        _decide(other, f"other-{i}", origin_s + 20.0)
    other.close()
    ids = [line["client_request_id"] for line in _lines(path)]
    assert ids == ["one-0-0", "one-0-1", "one-1-0", "other-0", "other-1", "other-2"]
    assert len(ids) <= 2 * 3


def test_the_supervisor_refuses_a_log_it_cannot_open(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"decision_log\.path"):
        _shared_decision_log("no-such-dir/d.jsonl", tmp_path)
