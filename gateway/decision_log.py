"""The decision log: what the policy saw and chose for each request, and what came of it.

Opt-in (`decision_log.path` in the config); off, the gateway pays two `is None` tests per request.
One JSON line per finished request, written when it finishes: its routing decisions (one per
attempt) with the view of the top candidates the policy scored, and the outcome the worker
reported (cached tokens, TTFT). `loadtest/replay` replays the same request stream through the
simulator and compares the two decision by decision.

In a prefill/decode pool a round's route is logged as one decision per leg, each with its `role`:
`prefill` and `decode` for a split (the decode leg with the transfer the chooser priced), `alone`
for a worker that serves the whole request. Mixed pools' decisions carry no role.

Nothing in a line identifies content: the request's ids, its tenant's namespace, token and block
counts, worker ids and load figures. Never prompt text, token ids or block keys. The file is
bounded: after `max_records` lines nothing more is written (the count of dropped lines is kept).

One run, one timeline. A gateway on its own starts a new file when it opens it (a restart does
not continue an old run's lines, whose `t_s` counted from another origin): the previous run's
file, if it holds any line, is moved to `<path>.prev` (replacing an older one), so the run before
a crash is still there after the restart. Its `t_s` count from its first decision. Under
`kvgate serve --processes N` every process appends to the same file, which the supervisor
started anew (moving the last run's aside the same way), and counts `t_s` from the origin the
supervisor hands every process (`ORIGIN_ENV`: its monotonic clock, which is the host's), so the
processes' lines, and those of a process it restarted, share one timeline. There a process
writes `max_records` lines less those the file held when it opened it: the processes started
together write up to `max_records` each, and a process restarted in place of one only what its
predecessors left of their `max_records`, so the file holds at most N × `max_records` however
often processes restart. Lines go out in batches (up to 256), each one `os.write` of whole
lines to a file opened `O_APPEND`, so lines of different processes do not interleave.
"""

from __future__ import annotations

import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.config.base import ConfigError
from gateway.logs import write_lines
from policies.base import RouteDecision, RouteRequest, WorkerId, WorkerView
from policies.pd import PdDecision

# Set by `kvgate serve --processes` (`gateway/multiproc.py`) for its children: the run's time
# origin (`time.monotonic()` seconds) shared by every process appending to the one file.
ORIGIN_ENV = "KVGATE_DECISION_LOG_ORIGIN_S"

# Where a new run moves the last run's file (`set_aside`).
PREV_SUFFIX = ".prev"

# Decisions awaiting their request's end; beyond this the oldest are dropped (a request that never
# finishes must not grow the log's memory).
MAX_PENDING = 16_384

HeldTokens = Callable[[RouteRequest, int, float], dict[WorkerId, int]]


class DecisionLog:
    """Collects decisions per request and writes one line when the request is recorded.

    Lines collect in a buffer flushed with the access log's cadence and at shutdown, so the hot
    path never writes to the file itself unless the buffer is full."""

    _max_lines = 256

    def __init__(
        self,
        path: str,
        max_records: int,
        top_candidates: int = 8,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.path = path
        self.max_records = max_records
        self.top_candidates = top_candidates
        self.written = 0  # lines this process wrote
        self.dropped = 0
        # Monotonic seconds the log's times count from: the run's (`ORIGIN_ENV`), else the first
        # decision's.
        self._origin_s = shared_origin(environ)
        fresh = self._origin_s is None
        try:
            self._fd = open_log(path, fresh=fresh)
            # A file shared by the processes of a run: what is in it counts against this process.
            self._room = max_records if fresh else max_records - lines_in(path, max_records)
        except OSError as exc:
            raise ConfigError(f"decision_log.path: cannot open {path!r}: {exc.strerror}") from None
        self._pending: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lines: list[bytes] = []

    def decided(
        self,
        request_id: str,
        route: RouteRequest,
        decision: RouteDecision,
        views: Sequence[WorkerView],
        policy: object,
        now_s: float,
    ) -> None:
        """Note one routing decision, before the policy hears of its dispatch (so the prefix
        policies' `held_tokens`, their per-worker prediction of cached tokens, is what they
        scored; other policies predict nothing)."""
        predicted = self._predicted(route, decision, policy, now_s)
        self._append(request_id, self._entry(route, decision, views, predicted, now_s, time.time()))

    def decided_pd(
        self,
        request_id: str,
        route: RouteRequest,
        decision: PdDecision,
        views: Sequence[WorkerView],
        policy: object,
        now_s: float,
        transfer_s: float,
    ) -> None:
        """Note one round of a prefill/decode pool, as `decided` does: the prefill leg and the
        decode leg of a split (the latter with the tokens it is to read and the chooser's
        `transfer_s` for them), or the worker alone."""
        predicted = self._predicted(route, decision.decode, policy, now_s)
        wall_s = time.time()
        if decision.prefill is None:
            entry = self._entry(route, decision.decode, views, predicted, now_s, wall_s)
            self._append(request_id, {"role": "alone", **entry})
            return
        prefill = self._entry(route, decision.prefill, views, predicted, now_s, wall_s)
        decode = self._entry(route, decision.decode, views, predicted, now_s, wall_s)
        decode["transfer_tokens"] = decision.transfer_tokens
        decode["transfer_s"] = round(transfer_s, 6)
        self._append(request_id, {"role": "prefill", **prefill})
        self._append(request_id, {"role": "decode", **decode})

    def _predicted(
        self, route: RouteRequest, decision: RouteDecision, policy: object, now_s: float
    ) -> dict[WorkerId, int]:
        if self._origin_s is None:
            self._origin_s = now_s
        held: HeldTokens | None = getattr(policy, "held_tokens", None)
        return held(route, decision.shared_prefix_blocks, now_s) if held is not None else {}

    def _entry(
        self,
        route: RouteRequest,
        decision: RouteDecision,
        views: Sequence[WorkerView],
        predicted: dict[WorkerId, int],
        now_s: float,
        wall_s: float,
    ) -> dict[str, Any]:
        """One decision; `wall_s` is the Unix time it was made (`time.time()` then)."""
        assert self._origin_s is not None
        return {
            "t_s": round(now_s - self._origin_s, 6),
            "wall_ts": round(wall_s, 3),
            "worker": decision.worker,
            "reason": decision.reason,
            "score_s": round(decision.score_s, 6),
            "predicted_cached_tokens": decision.matched_tokens,
            "queued_requests": route.queued_requests,
            "candidates": self._candidates(views, predicted, decision.worker, now_s),
        }

    def _append(self, request_id: str, entry: dict[str, Any]) -> None:
        decisions = self._pending.get(request_id)
        if decisions is None:
            decisions = self._pending[request_id] = []
            if len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        decisions.append(entry)

    def _candidates(
        self, views: Sequence[WorkerView], predicted: dict[WorkerId, int], chosen: WorkerId, now_s: float
    ) -> list[dict[str, Any]]:
        """The chosen worker and the strongest rivals: most predicted cached tokens, then least
        in flight. `prefill_age_s`: seconds since the prefill backlog last restarted (None: no
        backlog, or its progress not known; see `WorkerView.prefill_started_s`)."""
        ranked = sorted(
            (v for v in views if v.healthy or v.worker_id == chosen),
            key=lambda v: (v.worker_id != chosen, -predicted.get(v.worker_id, 0), v.in_flight_requests),
        )
        return [
            {
                "worker": v.worker_id,
                "predicted_cached_tokens": predicted.get(v.worker_id, 0),
                "in_flight": v.in_flight_requests,
                "prefill_tokens": v.in_flight_prefill_tokens,
                "prefill_pairs": v.in_flight_prefill_pairs,
                "prefill_age_s": None
                if v.prefill_started_s is None
                else round(now_s - v.prefill_started_s, 4),
                "decode_tokens": v.in_flight_decode_tokens,
                "decode_context_tokens": v.decode_context_tokens,
                "waiting": v.num_requests_waiting,
                "running": v.num_requests_running,
                "kv_usage": v.kv_usage,
            }
            for v in ranked[: self.top_candidates]
        ]

    def finished(
        self,
        request_id: str,
        client_request_id: str | None,
        route: RouteRequest,
        *,
        status: int,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        ttft_s: float | None,
    ) -> None:
        """Write the request's line (if it was routed at all and the log has room)."""
        decisions = self._pending.pop(request_id, None)
        if decisions is None:
            return
        if self.written >= self._room:
            self.dropped += 1
            return
        self.written += 1
        record = {
            "request_id": request_id,
            "client_request_id": client_request_id,
            "namespace": route.namespace,
            "n_prompt_tokens": route.n_prompt_tokens,
            "n_blocks": len(route.block_keys),
            "decisions": decisions,
            "status": status,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "ttft_ms": round(ttft_s * 1000, 3) if ttft_s is not None else None,
        }
        self._lines.append(orjson.dumps(record) + b"\n")
        if len(self._lines) >= self._max_lines:
            self.flush()

    def flush(self) -> None:
        write_lines(self._fd, self._lines)

    def close(self) -> None:
        self.flush()
        os.close(self._fd)


def shared_origin(environ: Mapping[str, str]) -> float | None:
    """The run's time origin the supervisor of `--processes` handed this process (`ORIGIN_ENV`);
    None for a gateway on its own."""
    raw = environ.get(ORIGIN_ENV)
    return float(raw) if raw else None


def open_log(path: str, *, fresh: bool) -> int:
    """The log file for appending whole lines; `fresh` starts a new run's file, the last run's
    moved aside (`set_aside`)."""
    if fresh:
        set_aside(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def set_aside(path: str) -> None:
    """Move the file at `path` to `<path>.prev`, replacing an older one, if it is a file that
    holds anything: an empty one (a run that crashed before its first line) would replace the
    last run with lines. Something else (a pipe, `/dev/stdout`) stays where it is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_size > 0:
        os.replace(path, path + PREV_SUFFIX)


def lines_in(path: str, limit: int) -> int:
    """How many lines the file at `path` holds, counted up to `limit` at least (reading stops
    there: a restarted process reads no more than its share of the file); 0 for what is not a
    file (a pipe would wait for its writers, this process among them)."""
    count = 0
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return 0
        while count < limit and (chunk := f.read(1 << 20)):
            count += chunk.count(b"\n")
    return count
