"""`kvgate bench drift`: prefix-hit ratio of a drifting agent workload, normalizer rules off and on,
against the drift-free ceiling of the same conversations.

Every request goes through the real `Normalizer` (approximate mode by default, `--mode tokenizer`
with a chat template that renders tools, tool calls and reasoning). The hit ratio is token
weighted: each request walks its block keys from block 0 through a prefix cache (infinite by
default, LRU with `--cache-blocks`) and counts the blocks found before the first miss; then all its
keys are inserted. Apps are tenants, so sessions of one app can share its system prompt and tools.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from loadtest.drift_workload import CLOCK_PREFIX, AgentRequest, DriftWorkloadConfig, generate
from prompt_normalizer.bench import git_sha
from prompt_normalizer.config import NormalizerConfig, VolatileRule
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.types import BlockKey, KeyIdentity

DRIFT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if not (loop.first and message.role == 'system') -%}
<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] -%}
<tool_call>{{ call.function.name }} {{ call.function.arguments }}</tool_call>
{%- endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

RULES_ON_YAML = f"""\
canonical_json: true
property_order: sort
volatile_rules:
  - {{name: clock, pattern: '{CLOCK_PREFIX}[^\\n]*', roles: [system], action: move_to_end}}
  - {{name: reasoning, field: reasoning_content, roles: [assistant], action: drop}}
"""


def rules_on(base: dict[str, object], without: str | None = None) -> NormalizerConfig:
    """Canonical JSON (schema properties sorted too) plus the two volatile rules this workload
    needs; `without` drops one of them (`clock`, `reasoning` or `canonical_json`) for the ablation
    rows."""
    rules = tuple(
        rule
        for rule in (
            VolatileRule(
                name="clock", pattern=CLOCK_PREFIX + r"[^\n]*", roles=("system",), action="move_to_end"
            ),
            VolatileRule(name="reasoning", field="reasoning_content", roles=("assistant",), action="drop"),
        )
        if rule.name != without
    )
    return NormalizerConfig.model_validate(
        {
            **base,
            "canonical_json": without != "canonical_json",
            "property_order": "sort",  # this workload's clients rebuild schemas in a new key order
            "volatile_rules": rules,
        }
    )


def rules_off(base: dict[str, object]) -> NormalizerConfig:
    return NormalizerConfig.model_validate({**base, "canonical_json": False, "unicode_nfc": False})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DriftWorkloadConfig()
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="agent sessions")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="turns per session")
    parser.add_argument(
        "--apps", type=int, default=defaults.apps, help="agent apps (own system prompt and tools)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument(
        "--mode",
        choices=("approximate", "tokenizer"),
        default="approximate",
        help="normalizer mode: text chunks or token ids (default approximate)",
    )
    parser.add_argument("--tokenizer-dir", help="tokenizer mode: a model dir (default: a BPE trained here)")
    parser.add_argument("--cache-blocks", type=int, default=0, help="LRU capacity in blocks (0: infinite)")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")


class PrefixCache:
    """Key → present, walked from block 0; LRU-bounded when `capacity_blocks` > 0."""

    def __init__(self, capacity_blocks: int = 0) -> None:
        self._capacity = capacity_blocks
        self._store: OrderedDict[BlockKey, None] = OrderedDict()

    def lookup_insert(self, keys: Iterable[BlockKey]) -> int:
        keys = list(keys)
        hits = 0
        for key in keys:
            if key not in self._store:
                break
            hits += 1
        for key in keys:
            self._store[key] = None
            self._store.move_to_end(key)
        while self._capacity and len(self._store) > self._capacity:
            self._store.popitem(last=False)
        return hits


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Token-weighted prefix-hit ratio of one replay, with the drift attributions seen."""

    name: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    normalize_ms_per_request: float
    drift_events: int
    drift_fields: dict[str, int]

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _field_class(path: str | None) -> str:
    return re.sub(r"\[\d+\]", "[*]", path) if path else "unattributed"


def replay(
    name: str, requests: list[AgentRequest], config: NormalizerConfig, block_size: int, cache_blocks: int
) -> ReplayResult:
    norm = Normalizer(config, b"bench-drift-secret")
    cache = PrefixCache(cache_blocks)
    prompt_tokens = hit_tokens = events = 0
    fields: Counter[str] = Counter()
    elapsed = 0.0
    for req in requests:
        identity = KeyIdentity(
            model_id="agent-model", namespace=f"app-{req.app}", block_size_tokens=block_size
        )
        start = time.perf_counter()
        prompt = norm.canonicalize("chat", req.body, identity)
        elapsed += time.perf_counter() - start
        prompt_tokens += prompt.n_tokens
        hit_tokens += cache.lookup_insert(prompt.block_keys) * block_size
        if prompt.drift is not None and prompt.drift.first_diff_block is not None:
            events += 1
            fields[_field_class(prompt.drift.field)] += 1
    return ReplayResult(
        name,
        len(requests),
        prompt_tokens,
        hit_tokens,
        elapsed * 1e3 / max(1, len(requests)),
        events,
        dict(fields.most_common()),
    )


def run(args: argparse.Namespace) -> int:
    workload = DriftWorkloadConfig(seed=args.seed, sessions=args.sessions, turns=args.turns, apps=args.apps)
    with tempfile.TemporaryDirectory() as tmp:
        base: dict[str, object] = {"mode": args.mode}
        tokenizer = None
        if args.mode == "tokenizer":
            base["tokenizer_dir"] = args.tokenizer_dir or _trained_model(Path(tmp), args.seed)
            tokenizer = args.tokenizer_dir or "byte-level BPE trained here (vocab 8000) + drift template"
        drifting = generate(workload, "drifting")
        clean = generate(workload, "drift_free")
        ceiling = replay("drift-free ceiling", clean, rules_off(base), args.block_size, args.cache_blocks)
        off = replay("drifting, rules off", drifting, rules_off(base), args.block_size, args.cache_blocks)
        on = replay("drifting, rules on", drifting, rules_on(base), args.block_size, args.cache_blocks)
        ablations = [
            replay(
                f"  on, without {name}", drifting, rules_on(base, name), args.block_size, args.cache_blocks
            )
            for name in ("clock", "canonical_json", "reasoning")
        ]
    results = [ceiling, off, on, *ablations]
    report = {
        "benchmark": "drift",
        "git_sha": git_sha(),
        "config": {
            "workload": asdict(workload),
            "block_size": args.block_size,
            "mode": args.mode,
            "tokenizer": tokenizer,
            "cache": f"LRU {args.cache_blocks} blocks" if args.cache_blocks else "infinite",
            "rules_on": RULES_ON_YAML,
        },
        "results": [
            {**asdict(r), "hit_ratio": r.hit_ratio, "of_ceiling": r.hit_ratio / ceiling.hit_ratio}
            for r in results
        ],
        "goal_rules_on_of_ceiling": 0.9,
    }
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0
    cache = report["config"]["cache"]  # type: ignore[index]
    print(
        f"kvgate bench drift  (git {report['git_sha']}, seed {args.seed}, {args.mode} mode, block "
        f"{args.block_size}, {cache} cache, {len(drifting)} requests)"
    )
    print(
        f"  {'replay':<32}{'prompt tokens':>14}{'hit ratio':>11}{'of ceiling':>12}{'ms/req':>9}{'drift':>7}"
    )
    for r in results:
        print(
            f"  {r.name:<32}{r.prompt_tokens:>14}{r.hit_ratio:>10.1%}{r.hit_ratio / ceiling.hit_ratio:>12.1%}"
            f"{r.normalize_ms_per_request:>9.2f}{r.drift_events:>7}"
        )
    verdict = "meets" if on.hit_ratio >= 0.9 * ceiling.hit_ratio else "MISSES"
    print(f"  rules on reach {on.hit_ratio / ceiling.hit_ratio:.1%} of the ceiling ({verdict} the 90 % goal)")
    for r in results[1:]:
        print(f"  drift attributed by field, {r.name.strip()}: {r.drift_fields}")
    print(orjson.dumps(report).decode())
    return 0


def _trained_model(directory: Path, seed: int) -> str:
    import json

    import numpy as np

    from prompt_normalizer.bench import train_tokenizer

    train_tokenizer(directory, np.random.default_rng(seed), 8000)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": DRIFT_TEMPLATE}))
    return str(directory)
