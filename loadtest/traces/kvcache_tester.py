"""kv-cache-tester (WEKA Claude Code) trace format: one agentic session in a single JSON object.

`{id, block_size, hash_id_scope: "local", tool_tokens, system_tokens, requests: [...]}`; a request is
`{t (s), in, out, hash_ids, api_time (s), ...}` and a sub-agent is `{t, type: "subagent", agent_id,
duration_ms, requests}` whose request times count from its start, `t − duration_ms`. Hash ids cover
full blocks only (the tail past `len(hash_ids) * block_size` is unhashed) and sub-agents share the
parent's id space.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest.traces.files import TraceFormatError, read_trace_bytes
from loadtest.workloads.records import BlockPrompt, WorkloadRequest


@dataclass(frozen=True, slots=True)
class KvCacheTesterTrace:
    """The requests of one session and the size of its system + tools prefix (tokens)."""

    trace_id: str
    block_size_tokens: int
    shared_prefix_tokens: int
    requests: tuple[WorkloadRequest, ...]


# A request already read: its id, and when the recording had its answer (`t` + `api_time`).
Sent = tuple[str, float]


def _request(
    session: str,
    t0_s: float,
    row: dict[str, Any],
    idx: int,
    size: int,
    tenant: str,
    shared_blocks: int,
    after: list[Sent],
) -> WorkloadRequest:
    """Row `idx` of `session`, sent at `t0_s + t`, after the answers of `after` (closed loop: the
    time from the last of them to this request in the recording is its think time)."""
    ids = tuple(int(h) for h in row["hash_ids"])
    prompt = BlockPrompt(ids, size, int(row["in"]), immutable_blocks=min(shared_blocks, len(ids)))
    sent_s = t0_s + float(row["t"])
    think_s = max(0.0, sent_s - max(end for _, end in after)) if after else 0.0
    return WorkloadRequest(
        f"{session}#{idx}",
        max(0.0, sent_s),
        tenant,
        session,
        prompt,
        max(1, int(row["out"])),
        tuple(rid for rid, _ in after),
        think_s,
    )


def _sent(r: WorkloadRequest, row: dict[str, Any]) -> Sent:
    return r.request_id, r.arrival_s + float(row.get("api_time", 0.0))


def parse_kvcache_tester(data: bytes, source: str, *, tenant: str = "trace") -> KvCacheTesterTrace:
    """The session in a kv-cache-tester trace's bytes; `source` names it in errors and is the
    fallback trace id (its file stem).

    A sub-agent's `t` is when it ended (`duration_ms` after it started, right after the main
    agent's turn that spawned it), and its requests' times count from its start. For a closed-loop
    replay each main-agent request follows the main agent's previous request and the sub-agents
    that ran since (the main agent waits for them, as Claude Code's task tool does); a sub-agent's
    first request follows the turn that spawned it, its later ones its own previous request."""
    try:
        doc = orjson.loads(data)
        trace_id = str(doc.get("id", _stem(source)))
        size = int(doc["block_size"])
        shared = int(doc.get("system_tokens", 0)) + int(doc.get("tool_tokens", 0))
        blocks = shared // size
        out: list[WorkloadRequest] = []
        main: list[Sent] = []  # the main agent's last request
        ended: list[Sent] = []  # each sub-agent's last request since then
        for i, row in enumerate(doc["requests"]):
            if row.get("type") == "subagent":
                session = f"{trace_id}/{row.get('agent_id', i)}"
                start_s = float(row["t"]) - float(row.get("duration_ms", 0.0)) / 1000.0
                last = main
                for j, sub in enumerate(row["requests"]):
                    r = _request(session, start_s, sub, j, size, tenant, blocks, last)
                    out.append(r)
                    last = [_sent(r, sub)]
                if last is not main:
                    ended.extend(last)
            else:
                r = _request(trace_id, 0.0, row, i, size, tenant, blocks, main + ended)
                out.append(r)
                main, ended = [_sent(r, row)], []
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{source}: not a kv-cache-tester trace ({exc})") from None
    out.sort(key=lambda r: r.arrival_s)
    return KvCacheTesterTrace(trace_id, size, shared, tuple(out))


def _stem(source: str) -> str:
    """`trace_0256` for `.../trace_0256.json` and `.../trace_0256.json.xz` alike."""
    name = Path(source).name
    for suffix in (".gz", ".xz"):
        name = name.removesuffix(suffix)
    return Path(name).stem


def read_kvcache_tester(path: str | Path, *, tenant: str = "trace") -> KvCacheTesterTrace:
    """The session in a kv-cache-tester trace file (plain, gzip or xz)."""
    return parse_kvcache_tester(read_trace_bytes(path), str(path), tenant=tenant)
