"""One entry point for every trace format: the format is recognised from the file's content."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loadtest.traces.kvcache_tester import read_kvcache_tester
from loadtest.traces.mooncake import TraceFormatError, read_mooncake
from loadtest.traces.users import replay_as_users
from loadtest.workloads.records import WorkloadRequest


@dataclass(frozen=True, slots=True)
class LoadedTrace:
    """The requests of a trace and what was read."""

    path: str
    trace_format: str
    block_size_tokens: int
    requests: tuple[WorkloadRequest, ...]


def load_trace(
    path: str | Path,
    *,
    users: int = 1,
    user_spread_s: float = 0.0,
    seed: int = 0,
    tenant_per_user: bool = False,
) -> LoadedTrace:
    """Read a Mooncake `.jsonl` or kv-cache-tester `.json` trace; `users > 1` replays it as many users
    (each its own tenant `trace-u<i>` with `tenant_per_user`)."""
    p = Path(path)
    if not p.is_file():
        raise TraceFormatError(f"{p}: no such trace file")
    with open(p, "rb") as f:
        first_line = f.readline(1 << 16)
    # A Mooncake file is one small object per line; a kv-cache-tester file is one big object.
    if b'"input_length"' not in first_line:
        t = read_kvcache_tester(p)
        shared_blocks = t.shared_prefix_tokens // t.block_size_tokens
        reqs = list(t.requests)
        if users > 1:
            reqs = replay_as_users(
                reqs,
                users,
                shared_prefix_blocks=shared_blocks,
                spread_s=user_spread_s,
                tenant_per_user=tenant_per_user,
                seed=seed,
            )
        return LoadedTrace(str(p), "kv-cache-tester", t.block_size_tokens, tuple(reqs))
    reqs = read_mooncake(p)
    if users > 1:
        reqs = replay_as_users(
            reqs, users, spread_s=user_spread_s, tenant_per_user=tenant_per_user, seed=seed
        )
    return LoadedTrace(str(p), "mooncake", 512, tuple(reqs))
