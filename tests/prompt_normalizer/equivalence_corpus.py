"""A seeded corpus of requests and the configs to run it under.

`test_equivalence.py` runs the corpus (`equivalence_records.run_case`) and compares each output's
digest with the goldens recorded in `data/equivalence_goldens.json`. The corpus covers what
canonicalization touches: ASCII and NFD / non-ASCII text, CRLF and trailing blanks, tools (unsorted
keys, non-function tools), tool calls (string, object and non-JSON arguments), JSON tool results,
media parts, template fields and flags, volatile-rule matches, sessions (header and body; growing,
drifting and evicted), public identities, several identities and block sizes, completions prompts of
every shape, and invalid requests (whose error message, param and code are part of the output).
"""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from prompt_normalizer.config import VolatileRule, ZoneConfig
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import NormalizerConfig
from prompt_normalizer.types import KeyIdentity

SEED = 20261129
N_REQUESTS = 300
SECRET = b"equivalence-secret"

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "weather",
    "Paris",
    "tomorrow",
    "assistant",
    "careful",
    "tools",
    "schema",
    "order",
    "session",
    "prefix",
    "block",
    "cache",
    "tenant",
    "model",
    "reply",
    "answer",
    "question",
    "detail",
    "summary",
]
NON_ASCII = ["café", "naïve", "Ångström", "東京", "Привет", "ﬁ", "e\u0301", "A\u030a", "한국어", "🙂"]
CLOCK = "Current date and time: 2026-11-{:02d} 12:{:02d}"
TRACE = "trace-id={:016x}"

RULES = (
    VolatileRule(name="clock", pattern=r"Current date and time: [^\n]*", roles=("system",)),
    VolatileRule(name="reasoning", field="reasoning_content", roles=("assistant",), action="drop"),
    VolatileRule(name="trace", pattern=r"trace-id=[0-9a-f]{16}", action="keep_and_warn"),
)
EARLIER_ONLY = (
    VolatileRule(name="reasoning", field="reasoning_content", scope="before_last_user", action="move_to_end"),
    VolatileRule(name="clock", pattern=r"Current date and time: [^\n]*", action="drop"),
)


def configs(tokenizer_dir: Path) -> dict[str, NormalizerConfig]:
    """The configs the corpus runs under (insertion order is the golden order)."""
    return {
        "demo": NormalizerConfig(),
        "rules_ws_sort": NormalizerConfig(
            chars_per_token=3, whitespace=True, tool_order="sort", volatile_rules=RULES
        ),
        "raw_fewshot": NormalizerConfig(
            canonical_json=False,
            unicode_nfc=False,
            zones=ZoneConfig(few_shot_messages=2, tools_immutable=False),
            volatile_rules=EARLIER_ONLY,
            volatile_role="user",
            session_fields=("user",),
        ),
        "small_limits": NormalizerConfig(
            chars_per_token=1, max_input_chars=6000, drift_sessions_max=3, drift_store_max_blocks=400
        ),
        "tokenizer": NormalizerConfig(mode="tokenizer", tokenizer_dir=str(tokenizer_dir)),
        "tokenizer_rules": NormalizerConfig(
            mode="tokenizer",
            tokenizer_dir=str(tokenizer_dir),
            content_format="openai",
            volatile_rules=RULES,
            volatile_role="user",
            tool_order="sort",
        ),
        "render": NormalizerConfig(mode="render", volatile_rules=RULES),
    }


IDENTITIES = (
    KeyIdentity(model_id="m", namespace="t1", block_size_tokens=4),
    KeyIdentity(model_id="m", namespace="t2", block_size_tokens=16, adapter="lora-a"),
    KeyIdentity(model_id="other", namespace="t1", block_size_tokens=1, epoch=3),
    KeyIdentity(model_id="m", block_size_tokens=8),  # the public namespace itself
)
PUBLIC = tuple(public_identity_of(ident) for ident in IDENTITIES)


@dataclass(slots=True)
class Case:
    """One call: which endpoint, which identity, whether public keys are asked, the session header."""

    endpoint: str
    body: Any
    identity: int
    public: bool
    session_key: str | None = None
    tags: list[str] = field(default_factory=list)


class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.systems = [self.text(rng.randint(20, 400), non_ascii=i == 0) for i in range(6)]
        self.tool_sets = [self.tools() for _ in range(4)]

    def text(self, n_words: int, *, non_ascii: bool = False, messy: bool = False) -> str:
        rng = self.rng
        words = [rng.choice(WORDS) for _ in range(n_words)]
        if non_ascii:
            for _ in range(max(1, n_words // 10)):
                word = rng.choice(NON_ASCII)
                words.insert(
                    rng.randrange(len(words) + 1), rng.choice([word, unicodedata.normalize("NFD", word)])
                )
        out = " ".join(words)
        if messy:
            out = out.replace(" gamma ", " gamma  \r\n").replace(" delta ", "\t\rdelta \n") + "  \n"
        return out

    def schema(self, depth: int = 0) -> dict[str, Any]:
        rng = self.rng
        props = {rng.choice(WORDS) + str(i): {"type": rng.choice(["string", "integer"])} for i in range(3)}
        if depth < 1 and rng.random() < 0.5:
            props["nested"] = self.schema(depth + 1)
        out: dict[str, Any] = {"type": "object", "properties": props, "required": sorted(props)[:1]}
        items = list(out.items())
        rng.shuffle(items)
        return dict(items)

    def tools(self) -> list[dict[str, Any]]:
        rng = self.rng
        tools: list[dict[str, Any]] = []
        for i in range(rng.randint(1, 4)):
            fn = {
                "name": f"{rng.choice(WORDS)}_{i}",
                "description": self.text(rng.randint(3, 30), non_ascii=rng.random() < 0.3),
                "parameters": self.schema(),
            }
            if rng.random() < 0.5:  # half the clients send schemas with their keys out of order
                items = list(fn.items())
                rng.shuffle(items)
                fn = dict(items)
            else:
                fn["parameters"] = orjson.loads(orjson.dumps(fn["parameters"], option=orjson.OPT_SORT_KEYS))
                fn = dict(sorted(fn.items()))
            tools.append({"function": fn, "type": "function"})
        if rng.random() < 0.2:
            tools.append({"type": rng.choice(["code_interpreter", "web_search"])})
        return tools

    def tool_call(self, j: int) -> dict[str, Any]:
        rng = self.rng
        args: Any = {"b": rng.randint(0, 9), "a": self.text(2)}
        kind = rng.random()
        if kind < 0.5:
            args = orjson.dumps(args).decode().replace(",", ", ")
        elif kind < 0.6:
            args = "not json " + self.text(2)
        elif kind < 0.7:
            args = '[3, {"z": 1, "y": 2}]'
        return {
            "id": f"call_{j}",
            "type": "function",
            "function": {"name": rng.choice(WORDS), "arguments": args},
        }

    def content(self, n_words: int) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.7:
            return self.text(n_words, non_ascii=rng.random() < 0.25, messy=rng.random() < 0.15)
        if r < 0.9:
            parts: list[dict[str, Any]] = [{"type": "text", "text": self.text(n_words)}]
            if rng.random() < 0.7:
                url = f"https://img.example/{rng.randint(0, 5)}.png"
                parts.insert(rng.randrange(2), {"type": "image_url", "image_url": {"url": url}})
            if rng.random() < 0.2:
                parts.append({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
            return parts
        return None if rng.random() < 0.5 else ""

    def conversation(self) -> list[dict[str, Any]]:
        rng = self.rng
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.85:
            system = rng.choice(self.systems)
            if rng.random() < 0.4:
                system = CLOCK.format(rng.randint(1, 28), rng.randint(0, 59)) + "\n" + system
            if rng.random() < 0.2:
                system += " " + TRACE.format(rng.getrandbits(64))
            messages.append({"role": rng.choice(["system", "system", "developer"]), "content": system})
        if rng.random() < 0.15:
            messages.append({"role": "user", "name": "example_user", "content": self.text(6)})
            messages.append({"role": "assistant", "name": "example_assistant", "content": self.text(6)})
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": self.content(rng.randint(1, 40))})
            if turn == 0 and rng.random() < 0.1:
                messages.append({"role": "system", "content": "late system " + self.text(4)})
            reply: dict[str, Any] = {"role": "assistant", "content": self.content(rng.randint(1, 30))}
            if rng.random() < 0.3:
                reply["reasoning_content"] = self.text(rng.randint(2, 20))
            if rng.random() < 0.3:
                reply["tool_calls"] = [self.tool_call(j) for j in range(rng.randint(1, 2))]
                messages.append(reply)
                result = '{"temp": 21, "city": "Paris", "unit": "C"}' if rng.random() < 0.6 else self.text(5)
                messages.append({"role": "tool", "tool_call_id": "call_0", "content": result})
            else:
                messages.append(reply)
        if rng.random() < 0.7:
            messages.pop()  # most requests end with a user (or tool) turn
        return messages

    def chat_body(self) -> dict[str, Any]:
        rng = self.rng
        body: dict[str, Any] = {"model": "m", "messages": self.conversation()}
        if rng.random() < 0.4:
            body["tools"] = rng.choice(self.tool_sets)
            if rng.random() < 0.3:
                body["tool_choice"] = "auto"
        if rng.random() < 0.1:
            body["chat_template_kwargs"] = {"enable_thinking": False, "date_string": "1 Jan 2026"}
        if rng.random() < 0.05:
            body["documents"] = [{"title": "doc", "text": self.text(10)}]
        if rng.random() < 0.05:
            body["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        for flag, p in (("add_generation_prompt", 0.1), ("continue_final_message", 0.05)):
            if rng.random() < p:
                body[flag] = rng.choice([True, False, None])
        if rng.random() < 0.05:
            body["add_special_tokens"] = True
        if rng.random() < 0.15:
            body["prompt_cache_key"] = f"pck-{rng.randint(0, 3)}"
        if rng.random() < 0.15:
            body["user"] = f"user-{rng.randint(0, 3)}"
        body["temperature"] = 0.2
        return body

    def completions_body(self) -> dict[str, Any]:
        rng = self.rng
        r = rng.random()
        prompt: Any
        if r < 0.4:
            prompt = self.text(rng.randint(1, 200), non_ascii=rng.random() < 0.3)
        elif r < 0.55:
            prompt = [self.text(rng.randint(1, 40)) for _ in range(rng.randint(1, 3))]
        elif r < 0.8:
            prompt = [rng.randrange(50_000) for _ in range(rng.randint(0, 120))]
        else:
            prompt = [
                [rng.randrange(50_000) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 3))
            ]
        body: dict[str, Any] = {"model": "m", "prompt": prompt}
        if rng.random() < 0.2:
            body["user"] = f"user-{rng.randint(0, 3)}"
        if rng.random() < 0.1:
            body["add_special_tokens"] = rng.choice([True, False])
        return body


def _break(k: int, body: dict[str, Any]) -> str:
    """Make one field of a chat body invalid (the k-th way, in turn); returns what was broken."""
    breakers: list[tuple[str, Callable[[], None]]] = [
        ("messages_not_list", lambda: body.update(messages={"role": "user"})),
        ("messages_empty", lambda: body.update(messages=[])),
        ("message_not_object", lambda: body["messages"].append("hi")),
        ("role_missing", lambda: body["messages"].append({"content": "x"})),
        ("content_int", lambda: body["messages"].append({"role": "user", "content": 3})),
        ("part_no_type", lambda: body["messages"].append({"role": "user", "content": [{"text": "x"}]})),
        (
            "part_text_int",
            lambda: body["messages"].append({"role": "user", "content": [{"type": "text", "text": 1}]}),
        ),
        ("tool_calls_dict", lambda: body["messages"].append({"role": "assistant", "tool_calls": {}})),
        (
            "tool_call_no_name",
            lambda: body["messages"].append({"role": "assistant", "tool_calls": [{"function": {}}]}),
        ),
        (
            "tool_call_args_int",
            lambda: body["messages"].append(
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]}
            ),
        ),
        ("tools_dict", lambda: body.update(tools={"a": 1})),
        ("tool_no_name", lambda: body.update(tools=[{"type": "function", "function": {}}])),
        ("tool_params_list", lambda: body.update(tools=[{"function": {"name": "f", "parameters": []}}])),
        ("documents_dict", lambda: body.update(documents={"a": 1})),
        ("document_str", lambda: body.update(documents=["x"])),
        ("template_int", lambda: body.update(chat_template=1)),
        ("kwargs_list", lambda: body.update(chat_template_kwargs=[])),
        ("flag_str", lambda: body.update(add_generation_prompt="maybe")),  # lax mode reads "yes"
        ("non_str_key", lambda: body["messages"].append({"role": "user", "content": "x", "meta": {1: 2}})),
        ("not_json_set", lambda: body["messages"].append({"role": "user", "content": "x", "meta": {1, 2}})),
    ]
    tag, apply = breakers[k % len(breakers)]
    apply()
    return tag


def corpus(seed: int = SEED, n: int = N_REQUESTS) -> list[Case]:
    """The seeded corpus: chat (mostly), completions, sessions that grow and drift, invalid bodies."""
    rng = random.Random(seed)
    gen = _Gen(rng)
    cases: list[Case] = []
    sessions: dict[str, dict[str, Any]] = {}
    while len(cases) < n:
        r = rng.random()
        ident, public = rng.randrange(len(IDENTITIES)), rng.random() < 0.3
        if r < 0.15:
            cases.append(Case("completions", gen.completions_body(), ident, public, tags=["completions"]))
            if rng.random() < 0.1:
                cases[-1].body["prompt"] = rng.choice([{"a": 1}, [1.5, 2.0], [-1], [2**40], [], 7])
                cases[-1].tags.append("bad_prompt")
        elif r < 0.35:
            # A session: the next request extends (or drifts from) the session's previous one.
            name = f"s{rng.randint(0, 5)}"
            prev = sessions.get(name)
            if prev is None or rng.random() < 0.15:
                body = gen.chat_body()
            else:
                body = orjson.loads(orjson.dumps(prev))
                body["messages"].append({"role": "assistant", "content": gen.text(rng.randint(1, 20))})
                body["messages"].append({"role": "user", "content": gen.content(rng.randint(1, 20))})
                if rng.random() < 0.3:
                    body["tools"] = rng.choice(gen.tool_sets)  # drift in the tools
                if rng.random() < 0.2 and body["messages"][0].get("role") == "system":
                    body["messages"][0]["content"] = rng.choice(gen.systems)  # drift in the system
            sessions[name] = body
            header = name if rng.random() < 0.5 else None
            if header is None:
                body = dict(body, prompt_cache_key=name)
            cases.append(Case("chat", body, 0, public, session_key=header, tags=["session"]))
        else:
            body = gen.chat_body()
            tags = ["chat"]
            if rng.random() < 0.2:
                tags.append(_break(sum("chat" in c.tags and len(c.tags) > 1 for c in cases), body))
            cases.append(Case("chat", body, ident, public, tags=tags))
    return cases
