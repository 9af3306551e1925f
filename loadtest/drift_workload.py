"""A seeded agent workload whose clients drift the way real ones do.

Agents of a few apps (each app: its own system prompt and tool schemas) run multi-turn tool-using
sessions. Every turn sends two chat requests: the user's message (the model answers with a tool
call), then the tool result (the model answers in text). The `drifting` variant reproduces three
habits of real agent clients:

- the system prompt carries the current date and time, updated on every request;
- tool schemas are rebuilt each request with their keys in a different order (and earlier tool-call
  arguments are re-serialized with shuffled keys);
- the reasoning text of earlier assistant turns is resent, but only for the most recent
  `keep_reasoning` assistant messages, so each new turn strips it from one older message.

The `drift_free` variant is the same conversations sent by a disciplined client: no clock in the
prompt, schemas and arguments in one key order, no reasoning resent. Its prefix-hit ratio is
the ceiling the drifting variant is compared with.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

Variant = Literal["drifting", "drift_free"]
CLOCK_PREFIX = "Current date and time: "


@dataclass(frozen=True, slots=True)
class DriftWorkloadConfig:
    """Shape of the workload; every field is recorded in the benchmark report."""

    seed: int = 0
    apps: int = 3
    sessions: int = 24
    turns: int = 8
    tools_per_app: int = 8
    system_words: int = 700
    user_words: int = 30
    answer_words: int = 60
    reasoning_words: int = 80
    tool_result_words: int = 40
    keep_reasoning: int = 1
    seconds_between_requests: float = 7.0


@dataclass(frozen=True, slots=True)
class AgentRequest:
    """One chat request of the workload, in arrival order."""

    app: int
    session: str
    turn: int
    step: Literal["call", "result"]
    body: dict[str, Any] = field(repr=False)


def _words(rng: random.Random, lexicon: list[str], n: int) -> str:
    return " ".join(rng.choice(lexicon) for _ in range(n))


def _shuffle_keys(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffle_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffle_keys(v, rng) for v in value]
    return value


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _tool(rng: random.Random, lexicon: list[str], index: int) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for j in range(rng.randint(3, 6)):
        name = f"{rng.choice(lexicon)}_{j}"
        kind = rng.choice(["string", "integer", "boolean", "enum"])
        if kind == "enum":
            props[name] = {
                "type": "string",
                "enum": [rng.choice(lexicon) for _ in range(4)],
                "description": _words(rng, lexicon, 8),
            }
        else:
            props[name] = {"type": kind, "description": _words(rng, lexicon, 8)}
    return {
        "type": "function",
        "function": {
            "name": f"tool_{index}_{rng.choice(lexicon)}",
            "description": _words(rng, lexicon, 20),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:2]},
        },
    }


@dataclass
class _Session:
    app: int
    name: str
    start: datetime
    history: list[dict[str, Any]] = field(default_factory=list)
    requests_sent: int = 0


def generate(config: DriftWorkloadConfig, variant: Variant) -> list[AgentRequest]:
    """All requests of the workload in arrival order (same conversations for both variants)."""
    content = random.Random(config.seed)  # drives what is said: identical for both variants
    drift = random.Random(config.seed + 1)  # drives key orders only
    lexicon = [
        "".join(content.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(content.randint(2, 9)))
        for _ in range(2000)
    ]
    systems = [_words(content, lexicon, config.system_words) for _ in range(config.apps)]
    tools = [[_tool(content, lexicon, i) for i in range(config.tools_per_app)] for _ in range(config.apps)]
    epoch = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
    sessions = [
        _Session(s % config.apps, f"agent-{s}", epoch + timedelta(seconds=37 * s))
        for s in range(config.sessions)
    ]
    out: list[AgentRequest] = []
    for turn in range(config.turns):
        order = list(sessions)
        content.shuffle(order)
        for sess in order:
            out.extend(_turn(config, variant, sess, turn, systems, tools, lexicon, content, drift))
    return out


def _turn(
    config: DriftWorkloadConfig,
    variant: Variant,
    sess: _Session,
    turn: int,
    systems: list[str],
    tools: list[list[dict[str, Any]]],
    lexicon: list[str],
    content: random.Random,
    drift: random.Random,
) -> list[AgentRequest]:
    app_tools = tools[sess.app]
    sess.history.append({"role": "user", "content": _words(content, lexicon, config.user_words)})
    tool = content.choice(app_tools)["function"]
    args = {name: content.choice(lexicon) for name in tool["parameters"]["properties"]}
    call_reasoning = _words(content, lexicon, config.reasoning_words)
    call = {
        "id": f"call_{sess.name}_{turn}",
        "type": "function",
        "function": {"name": tool["name"], "arguments": args},
    }
    result = _words(content, lexicon, config.tool_result_words)
    answer = _words(content, lexicon, config.answer_words)
    answer_reasoning = _words(content, lexicon, config.reasoning_words)
    requests = []
    for step in ("call", "result"):
        if step == "result":
            sess.history.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call],
                    "reasoning_content": call_reasoning,
                }
            )
            sess.history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        body = _body(config, variant, sess, systems[sess.app], app_tools, drift)
        requests.append(AgentRequest(sess.app, sess.name, turn, step, body))
        sess.requests_sent += 1
    sess.history.append({"role": "assistant", "content": answer, "reasoning_content": answer_reasoning})
    return requests


def _body(
    config: DriftWorkloadConfig,
    variant: Variant,
    sess: _Session,
    system: str,
    app_tools: list[dict[str, Any]],
    drift: random.Random,
) -> dict[str, Any]:
    if variant == "drifting":
        now = sess.start + timedelta(seconds=config.seconds_between_requests * sess.requests_sent)
        schema = [_shuffle_keys(t, drift) for t in app_tools]
    else:
        now = sess.start  # unused: a disciplined client keeps the clock out of the prompt
        schema = [_sorted_keys(t) for t in app_tools]
    head, _, rest = system.partition(" ")
    clock = f"{CLOCK_PREFIX}{now.isoformat()}\n" if variant == "drifting" else ""
    system_text = f"You are agent {head}.\n{clock}{rest}"
    assistants = [i for i, m in enumerate(sess.history) if m["role"] == "assistant"]
    keep = set(assistants[-config.keep_reasoning :]) if config.keep_reasoning > 0 else set()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_text}]
    for i, msg in enumerate(sess.history):
        msg = dict(msg)
        reasoning = msg.pop("reasoning_content", None)
        if variant == "drifting" and reasoning is not None and i in keep:
            msg["reasoning_content"] = reasoning
        if "tool_calls" in msg:
            msg["tool_calls"] = [
                _serialize_call(c, drift if variant == "drifting" else None) for c in msg["tool_calls"]
            ]
        messages.append(msg)
    return {"model": "agent-model", "messages": messages, "tools": schema, "user": sess.name}


def _serialize_call(call: dict[str, Any], rng: random.Random | None) -> dict[str, Any]:
    args = call["function"]["arguments"]
    args = _shuffle_keys(args, rng) if rng is not None else _sorted_keys(args)
    return {**call, "function": {"name": call["function"]["name"], "arguments": json.dumps(args)}}
