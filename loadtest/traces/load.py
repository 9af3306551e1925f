"""One entry point for every trace format: the format is recognised from the file's content."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loadtest.traces.catalog import resolve_trace
from loadtest.traces.files import read_trace_bytes
from loadtest.traces.kvcache_tester import parse_kvcache_tester
from loadtest.traces.mooncake import MOONCAKE_BLOCK_TOKENS, parse_mooncake
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
    """Read a Mooncake `.jsonl` or kv-cache-tester `.json` trace, plain, gzip or xz, or a shipped
    trace by name (`loadtest.traces.catalog`); `users > 1` replays it as many users (each its own
    tenant `trace-u<i>` with `tenant_per_user`)."""
    p = resolve_trace(path)
    data = read_trace_bytes(p)
    # A Mooncake file is one small object per line; a kv-cache-tester file is one big object.
    first_line = data[: 1 << 16].split(b"\n", 1)[0]
    if b'"input_length"' not in first_line:
        t = parse_kvcache_tester(data, str(p))
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
    reqs = parse_mooncake(data, str(p))
    if users > 1:
        reqs = replay_as_users(
            reqs, users, spread_s=user_spread_s, tenant_per_user=tenant_per_user, seed=seed
        )
    return LoadedTrace(str(p), "mooncake", MOONCAKE_BLOCK_TOKENS, tuple(reqs))
