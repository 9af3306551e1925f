"""kv-cache-tester (WEKA Claude Code) trace format: one agentic session in a single JSON object.

`{id, block_size, hash_id_scope: "local", tool_tokens, system_tokens, requests: [...]}`; a request is
`{t (s), in, out, hash_ids, ...}` and a sub-agent is `{t, type: "subagent", agent_id, requests}` whose
request times are relative to the sub-agent's `t`. Hash ids cover full blocks only (the tail past
`len(hash_ids) * block_size` is unhashed) and sub-agents share the parent's id space.
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


def _request(
    trace_id: str,
    session: str,
    t0_s: float,
    row: dict[str, Any],
    idx: int,
    size: int,
    tenant: str,
    shared_blocks: int,
) -> WorkloadRequest:
    ids = tuple(int(h) for h in row["hash_ids"])
    prompt = BlockPrompt(ids, size, int(row["in"]), immutable_blocks=min(shared_blocks, len(ids)))
    rid = f"{session}#{idx}"
    return WorkloadRequest(rid, t0_s + float(row["t"]), tenant, session, prompt, max(1, int(row["out"])))


def parse_kvcache_tester(data: bytes, source: str, *, tenant: str = "trace") -> KvCacheTesterTrace:
    """The session in a kv-cache-tester trace's bytes; `source` names it in errors and is the
    fallback trace id (its file stem)."""
    try:
        doc = orjson.loads(data)
        trace_id = str(doc.get("id", _stem(source)))
        size = int(doc["block_size"])
        shared = int(doc.get("system_tokens", 0)) + int(doc.get("tool_tokens", 0))
        out: list[WorkloadRequest] = []
        for i, row in enumerate(doc["requests"]):
            if row.get("type") == "subagent":
                session = f"{trace_id}/{row.get('agent_id', i)}"
                for j, sub in enumerate(row["requests"]):
                    out.append(
                        _request(trace_id, session, float(row["t"]), sub, j, size, tenant, shared // size)
                    )
            else:
                out.append(_request(trace_id, trace_id, 0.0, row, i, size, tenant, shared // size))
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
