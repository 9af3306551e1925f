"""Reading a gateway decision log (`gateway/decision_log.py`) back into typed records.

The replay names workers `w0..wN-1` as the simulator does, in the order of the workers' ids
(their URLs) sorted: any fixed renaming works, since the replay places every request where the
HTTP run placed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as the policy saw it when it decided (request tokens, the gateway's estimate)."""

    worker: str
    predicted_cached_tokens: int
    in_flight: int
    prefill_tokens: int
    decode_tokens: int
    waiting: int | None
    running: int | None

    @classmethod
    def of(cls, raw: dict[str, Any], rename: dict[str, str]) -> Candidate:
        return cls(
            rename.get(raw["worker"], raw["worker"]),
            int(raw.get("predicted_cached_tokens") or 0),
            int(raw.get("in_flight") or 0),
            int(raw.get("prefill_tokens") or 0),
            int(raw.get("decode_tokens") or 0),
            raw.get("waiting"),
            raw.get("running"),
        )


@dataclass(frozen=True, slots=True)
class HttpDecision:
    """A request's first routing decision in the HTTP run, and what the worker reported."""

    request_id: str  # the client's id: the workload request's
    t_s: float  # decision time, seconds after the run's origin (`rebase` counts from the first)
    worker: str
    reason: str
    predicted_cached_tokens: int
    candidates: tuple[Candidate, ...]
    n_prompt_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None


def read_decisions(
    path: Path, skip_prefix: str | None = "warmup-"
) -> tuple[dict[str, HttpDecision], list[str]]:
    """The log's decisions by client request id (requests without one, or whose id starts with
    `skip_prefix` when given, are left out), and the workers' ids in the order that names them
    w0, w1, ..."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    workers = sorted({c["worker"] for rec in lines for d in rec["decisions"] for c in d["candidates"]})
    rename = {w: f"w{i}" for i, w in enumerate(workers)}
    out: dict[str, HttpDecision] = {}
    for rec in lines:
        rid = rec.get("client_request_id")
        if not rid or (skip_prefix is not None and rid.startswith(skip_prefix)) or not rec["decisions"]:
            continue
        d = rec["decisions"][0]
        out[rid] = HttpDecision(
            rid,
            float(d["t_s"]),
            rename[d["worker"]],
            d["reason"],
            int(d["predicted_cached_tokens"]),
            tuple(Candidate.of(c, rename) for c in d["candidates"]),
            int(rec["n_prompt_tokens"]),
            rec.get("prompt_tokens"),
            rec.get("cached_tokens"),
            rec.get("ttft_ms"),
        )
    return out, workers


def rebase(decisions: Iterable[HttpDecision]) -> float:
    """The time of the earliest decision (the stream's first request's), to count from."""
    return min((d.t_s for d in decisions), default=0.0)
