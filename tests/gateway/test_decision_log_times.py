"""The decision log's times: each decision's `wall_ts` is when it was made (not when its request
ended), and its `t_s` count from one origin per run, shared by the processes of
`kvgate serve --processes`."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.decision_log import DecisionLog
from policies.base import RouteDecision, RouteRequest, WorkerId, WorkerView

REQ = RouteRequest("r", "p", "t", "tenant:t", (), 10, 16)
VIEW = WorkerView(WorkerId("w"))


def _lines(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_each_decisions_wall_ts_is_when_it_was_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream's decision is stamped when the policy chose, not at the stream's end."""
    clock = [1_000.0]
    monkeypatch.setattr("gateway.decision_log.time.time", lambda: clock[0])
    log = DecisionLog(str(tmp_path / "d.jsonl"), max_records=10)
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
