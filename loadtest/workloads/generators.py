"""Seeded synthetic workloads with known prefix structure.

- `agent_sessions`: multi-turn tool-using agents. Every session of a tenant starts with the same
  system prompt and tool schemas (with `shared_prefix`, the same ones across all tenants: one
  agent product serving many customers); each turn appends to the session's history (user turn,
  the assistant's tool call, the tool result, the assistant's answer), so a session is append-only.
- `rag`: questions over a shared corpus; each prompt is a system prompt, a few retrieved documents
  (Zipf popularity) and a question.
- `zipf_tenants`: many tenants with Zipf-distributed traffic, each with a few long private prefixes;
  with `shared_system_chars` > 0 every prompt starts with one system prompt common to all tenants
  and the tenant's private prefix opens the user message instead.
- `generated_shared_prefix`: SGLang's `generated-shared-prefix` benchmark shape (groups of prompts
  sharing a long system prompt, shuffled); defaults are SGLang's (64 groups x 16 prompts, 2048 + 128
  tokens, 256 output tokens).

Lengths are in characters of ASCII text, which is tokens for the emulator's byte tokenizer (chat
prompts add the template's role markers on top). Arrivals are Poisson at `rate_per_s`.
"""

from __future__ import annotations

import json
from typing import cast

import numpy as np

from loadtest.workloads.records import ChatMessage, ChatPrompt, TextPrompt, ToolCall, WorkloadRequest
from loadtest.workloads.text import synth_text


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, sum(name.encode())])


def _between(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def _poisson_times(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be positive")
    gaps = rng.exponential(1.0 / rate_per_s, size=n)
    return np.cumsum(gaps)


def _zipf_weights(n: int, alpha: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return cast(np.ndarray, w / w.sum())


def _tool_schema(seed: int, tenant: str, i: int, desc_chars: int) -> str:
    schema = {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": synth_text(f"tooldesc/{seed}/{tenant}/{i}", desc_chars),
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def agent_sessions(
    seed: int = 0,
    *,
    n_tenants: int = 2,
    n_sessions: int = 48,
    turns_per_session: int = 6,
    system_chars: int = 1500,
    n_tools: int = 8,
    tool_desc_chars: int = 200,
    user_chars: tuple[int, int] = (60, 240),
    tool_result_chars: tuple[int, int] = (200, 1500),
    answer_chars: tuple[int, int] = (40, 200),
    output_tokens: tuple[int, int] = (30, 200),
    think_time_s: tuple[float, float] = (1.0, 6.0),
    session_rate_per_s: float = 1.0,
    shared_prefix: bool = False,
) -> list[WorkloadRequest]:
    """Each turn sends two requests: the user's turn (answered by a tool call), then the tool result."""
    rng = _rng(seed, "agent")
    starts = _poisson_times(rng, n_sessions, session_rate_per_s)
    out: list[WorkloadRequest] = []
    for s in range(n_sessions):
        tenant = f"t{s % n_tenants}"
        owner = "shared" if shared_prefix else tenant
        tools = tuple(_tool_schema(seed, owner, i, tool_desc_chars) for i in range(n_tools))
        history: list[ChatMessage] = [ChatMessage("system", synth_text(f"sys/{seed}/{owner}", system_chars))]
        t = float(starts[s])
        session = f"agent-{s}"
        for turn in range(turns_per_session):
            key = f"{seed}/{s}/{turn}"
            history.append(ChatMessage("user", synth_text(f"user/{key}", _between(rng, user_chars))))
            out.append(
                WorkloadRequest(
                    f"{session}-{turn}a",
                    t,
                    tenant,
                    session,
                    ChatPrompt(tuple(history), tools),
                    _between(rng, output_tokens),
                )
            )
            call = ToolCall(f"call_{s}_{turn}", f"tool_{int(rng.integers(n_tools))}", '{"query":"q"}')
            history.append(ChatMessage("assistant", "", tool_calls=(call,)))
            history.append(
                ChatMessage(
                    "tool",
                    synth_text(f"tool/{key}", _between(rng, tool_result_chars)),
                    tool_call_id=call.call_id,
                )
            )
            t += float(rng.uniform(*think_time_s)) / 4  # tool execution is faster than a human
            out.append(
                WorkloadRequest(
                    f"{session}-{turn}b",
                    t,
                    tenant,
                    session,
                    ChatPrompt(tuple(history), tools),
                    _between(rng, output_tokens),
                )
            )
            history.append(ChatMessage("assistant", synth_text(f"ans/{key}", _between(rng, answer_chars))))
            t += float(rng.uniform(*think_time_s))
    out.sort(key=lambda r: r.arrival_s)
    return out


def rag(
    seed: int = 0,
    *,
    n_requests: int = 400,
    n_docs: int = 120,
    docs_per_request: int = 3,
    doc_chars: tuple[int, int] = (800, 3000),
    zipf_alpha: float = 1.1,
    system_chars: int = 400,
    question_chars: tuple[int, int] = (30, 150),
    output_tokens: tuple[int, int] = (50, 300),
    rate_per_s: float = 4.0,
) -> list[WorkloadRequest]:
    """Documents appear in retrieval order: prompts share a prefix only up to their first differing doc."""
    rng = _rng(seed, "rag")
    weights = _zipf_weights(n_docs, zipf_alpha)
    doc_len = [_between(rng, doc_chars) for _ in range(n_docs)]
    system = synth_text(f"ragsys/{seed}", system_chars)
    times = _poisson_times(rng, n_requests, rate_per_s)
    out: list[WorkloadRequest] = []
    for i in range(n_requests):
        picked = rng.choice(n_docs, size=min(docs_per_request, n_docs), replace=False, p=weights)
        docs = "\n\n".join(f"[doc {d}]\n" + synth_text(f"doc/{seed}/{d}", doc_len[d]) for d in picked)
        question = synth_text(f"q/{seed}/{i}", _between(rng, question_chars))
        prompt = ChatPrompt(
            (ChatMessage("system", system), ChatMessage("user", f"{docs}\n\nQuestion: {question}"))
        )
        out.append(
            WorkloadRequest(
                f"rag-{i}", float(times[i]), "rag", f"rag-{i}", prompt, _between(rng, output_tokens)
            )
        )
    return out


def zipf_tenants(
    seed: int = 0,
    *,
    n_requests: int = 600,
    n_tenants: int = 24,
    zipf_alpha: float = 1.2,
    prefixes_per_tenant: int = 3,
    prefix_chars: tuple[int, int] = (500, 4000),
    suffix_chars: tuple[int, int] = (50, 400),
    output_tokens: tuple[int, int] = (20, 200),
    rate_per_s: float = 6.0,
    shared_system_chars: int = 0,
) -> list[WorkloadRequest]:
    """Tenant by Zipf(alpha); within a tenant one of its prefixes uniformly; then a fresh suffix."""
    rng = _rng(seed, "zipf")
    weights = _zipf_weights(n_tenants, zipf_alpha)
    prefix_len = rng.integers(prefix_chars[0], prefix_chars[1] + 1, size=(n_tenants, prefixes_per_tenant))
    times = _poisson_times(rng, n_requests, rate_per_s)
    out: list[WorkloadRequest] = []
    for i in range(n_requests):
        t = int(rng.choice(n_tenants, p=weights))
        k = int(rng.integers(prefixes_per_tenant))
        private = synth_text(f"zpre/{seed}/{t}/{k}", int(prefix_len[t, k]))
        user = synth_text(f"zsuf/{seed}/{i}", _between(rng, suffix_chars))
        if shared_system_chars > 0:
            shared = synth_text(f"zsys/{seed}", shared_system_chars)
            prompt = ChatPrompt((ChatMessage("system", shared), ChatMessage("user", f"{private}\n\n{user}")))
        else:
            prompt = ChatPrompt((ChatMessage("system", private), ChatMessage("user", user)))
        out.append(
            WorkloadRequest(
                f"zipf-{i}", float(times[i]), f"tenant{t}", f"zipf-{i}", prompt, _between(rng, output_tokens)
            )
        )
    return out


def generated_shared_prefix(
    seed: int = 0,
    *,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate_per_s: float = 8.0,
    ordered: bool = False,
) -> list[WorkloadRequest]:
    """Completion prompts `system prompt of the group + question`, shuffled unless `ordered`."""
    rng = _rng(seed, "gsp")
    pairs = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
    if not ordered:
        rng.shuffle(pairs)
    times = _poisson_times(rng, len(pairs), rate_per_s)
    out: list[WorkloadRequest] = []
    for i, (g, q) in enumerate(pairs):
        text = synth_text(f"gsp-sys/{seed}/{g}", system_prompt_len) + synth_text(
            f"gsp-q/{seed}/{g}/{q}", question_len
        )
        out.append(
            WorkloadRequest(f"gsp-{g}-{q}", float(times[i]), "gsp", f"gsp-{g}", TextPrompt(text), output_len)
        )
    return out
