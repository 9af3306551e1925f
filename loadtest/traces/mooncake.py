"""Mooncake FAST'25 trace format: one JSON object per line.

`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}` where
`hash_ids` are 512-token blocks, prefix-chained, the last one partial. The trace has no tenants or
sessions: every request belongs to tenant "trace" and has no session (an empty `session`).
"""

from __future__ import annotations

from pathlib import Path

import orjson

# Re-exported: the trace commands import the error from here.
from loadtest.traces.files import TraceFormatError as TraceFormatError
from loadtest.traces.files import read_trace_bytes
from loadtest.workloads.records import BlockPrompt, WorkloadRequest

MOONCAKE_BLOCK_TOKENS = 512


def parse_mooncake(
    data: bytes, source: str, *, tenant: str = "trace", block_size_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[WorkloadRequest]:
    """Every request of a Mooncake jsonl trace's bytes, in arrival order; `source` names it in errors."""
    out: list[WorkloadRequest] = []
    for line_no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            arrival_s = float(row["timestamp"]) / 1000.0
            n_tokens = int(row["input_length"])
            n_out = int(row["output_length"])
            ids = tuple(int(h) for h in row["hash_ids"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{source}:{line_no}: not a Mooncake trace row ({exc})") from None
        try:
            prompt = BlockPrompt(ids, block_size_tokens, n_tokens)
            rid = f"mc-{line_no}"
            out.append(WorkloadRequest(rid, arrival_s, tenant, "", prompt, max(1, n_out)))
        except ValueError as exc:
            raise TraceFormatError(f"{source}:{line_no}: {exc}") from None
    out.sort(key=lambda r: r.arrival_s)
    return out


def read_mooncake(
    path: str | Path, *, tenant: str = "trace", block_size_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[WorkloadRequest]:
    """Every request of a Mooncake jsonl trace file (plain, gzip or xz), in arrival order."""
    data = read_trace_bytes(path)
    return parse_mooncake(data, str(path), tenant=tenant, block_size_tokens=block_size_tokens)
