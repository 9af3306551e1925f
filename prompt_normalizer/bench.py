"""`kvgate bench keys`: block-key time of a long prompt, and tokenization time, on this machine.

Key time is measured on token ids that are already a uint32 array (what the tokenizer or the render
endpoint hands over), against two baselines timed in the same run: a per-token Python packing of
each block (what the vectorized view avoids) and one xxh3 call over the whole buffer (the floor).
Tokenization (chat-template rendering and BPE encoding) is timed separately, per 1k tokens, with
`--tokenizer-dir` or with a byte-level BPE trained here from seeded synthetic text.

The typical gateway request (a ~1.2 KB system prompt and a short user turn, the demo normalizer
config) is timed per request in CPU time (`time.process_time`, so other processes on a busy
machine do not inflate it), beside a floor measured in the same run: `orjson.dumps` of the body
plus one xxh3 over it. `--chat-only` runs just that part.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import xxhash

from prompt_normalizer.canonical import canonicalize_chat
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

# Per-request CPU goal of the typical chat request in approximate mode (docs/benchmarks.md).
APPROXIMATE_GOAL_US = 10.0

BENCH_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=32_768, help="prompt length in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument("--repeats", type=int, default=31, help="timed repeats (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts (default 0)")
    parser.add_argument("--tokenizer-dir", help="a model dir (tokenizer.json + tokenizer_config.json)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="vocab of the BPE trained when no dir")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")
    parser.add_argument(
        "--chat-only", action="store_true", help="only the per-request time of the typical chat request"
    )
    parser.add_argument("--chat-requests", type=int, default=5000, help="requests per timed chat loop")


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _per_token_baseline(ids: list[int], block: int, seed: int) -> list[int]:
    keys = []
    prev = seed
    for start in range(0, len(ids) - block + 1, block):
        data = b"".join(t.to_bytes(4, "little") for t in ids[start : start + block])
        prev = xxhash.xxh3_64_intdigest(data, prev)
        keys.append(prev)
    return keys


def synthetic_words(rng: np.random.Generator, n_words: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(3000)]
    picks = rng.zipf(1.3, size=n_words) % len(lexicon)
    return [lexicon[i] for i in picks]


def train_tokenizer(
    directory: Path, rng: np.random.Generator, vocab_size: int, n_words: int = 120_000
) -> Path:
    """A byte-level BPE trained on seeded synthetic text, saved with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = synthetic_words(rng, n_words)
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": BENCH_TEMPLATE}))
    return directory


def _chat_of_tokens(norm: Normalizer, rng: np.random.Generator, target: int) -> dict[str, Any]:
    """A system + multi-turn chat whose rendered prompt is close to `target` tokens."""
    words = synthetic_words(rng, target * 2)
    system = " ".join(words[:600])
    messages = [{"role": "system", "content": system}]
    ident = KeyIdentity(model_id="bench")
    pos = 600
    while True:
        for role in ("user", "assistant"):
            messages.append({"role": role, "content": " ".join(words[pos : pos + 300])})
            pos += 300
        body = {"messages": messages}
        if norm.canonicalize("chat", body, ident).n_tokens >= target or pos >= len(words) - 300:
            return body


def cpu_per_call_s(fn: Callable[[], object], number: int, repeats: int) -> float:
    """Best CPU time per call over `repeats` loops of `number` calls (process time, not wall)."""
    fn()  # warm up
    return min(timeit.repeat(fn, number=number, repeat=repeats, timer=time.process_time)) / number


def typical_chat_body(words: list[str], system_chars: int = 1200) -> dict[str, Any]:
    """A ~1.2 KB system prompt (from `words`) and a short user turn, as a chat client sends them."""
    system = " ".join(words)[:system_chars]
    return {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Paris tomorrow?"},
        ],
        "max_tokens": 64,
        "temperature": 0.2,
    }


def chat_request_report(args: argparse.Namespace, model_dir: Path | None) -> dict[str, Any]:
    """Per-request canonicalize CPU time of the typical chat request, against the floor."""
    rng = np.random.default_rng(args.seed + 1)
    n_variants, per_body = 2048, 400
    words = synthetic_words(rng, per_body * (n_variants + 1))
    body = typical_chat_body(words[:per_body])
    number = max(1, args.chat_requests)
    repeats = 5
    ident = KeyIdentity(model_id="demo-model", namespace="tenant", block_size_tokens=args.block_size)
    public = public_identity_of(ident)
    norm = Normalizer(NormalizerConfig(), b"bench-secret")  # the demo config: approximate mode
    floor_s = cpu_per_call_s(lambda: xxhash.xxh3_64_intdigest(orjson.dumps(body)), number, repeats)
    strict_s = cpu_per_call_s(lambda: norm.canonicalize("chat", body, ident), number, repeats)
    shared_s = cpu_per_call_s(lambda: norm.canonicalize("chat", body, ident, public), number, repeats)
    # A new system prompt on every request (more distinct prompts than the key memory holds).
    variants = [typical_chat_body(words[i * per_body : (i + 1) * per_body]) for i in range(1, n_variants + 1)]
    cycle = itertools.cycle(variants)
    cold_s = cpu_per_call_s(lambda: norm.canonicalize("chat", next(cycle), ident), number, repeats)
    report: dict[str, Any] = {
        "chat_body_bytes": len(orjson.dumps(body)),
        "chat_requests_per_loop": number,
        "floor_dumps_xxh3_us": floor_s * 1e6,
        "approximate_us": strict_s * 1e6,
        "approximate_public_keys_us": shared_s * 1e6,
        "approximate_new_system_prompt_us": cold_s * 1e6,
        "approximate_goal_us": APPROXIMATE_GOAL_US,
        "approximate_ratio_vs_floor": strict_s / floor_s,
    }
    if model_dir is not None:
        tnorm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(model_dir)), b"bench-secret")
        n_tok = max(1, number // 20)
        tok_s = cpu_per_call_s(lambda: tnorm.canonicalize("chat", body, ident), n_tok, repeats)
        tok = tnorm.chat_tokenizer
        assert tok is not None
        text = tok.render(canonicalize_chat(body, tnorm.config, b"k" * 32))
        encode_s = cpu_per_call_s(
            lambda: tok.encode(text, add_special_tokens=False, with_offsets=False), n_tok, repeats
        )
        report["tokenizer_us"] = tok_s * 1e6
        report["tokenizer_bpe_encode_us"] = encode_s * 1e6
        report["tokenizer_tokens"] = len(
            tok.encode(text, add_special_tokens=False, with_offsets=False).tokens
        )
    return report


def print_chat_report(chat: dict[str, Any]) -> None:
    floor = chat["floor_dumps_xxh3_us"]
    verdict = "meets" if chat["approximate_us"] <= chat["approximate_goal_us"] else "MISSES"
    print(f"  typical chat request ({chat['chat_body_bytes']} B body), CPU time per request:")
    print(f"    floor, orjson.dumps + one xxh3:           {floor:8.2f} us")
    print(
        f"    approximate (demo config):                {chat['approximate_us']:8.2f} us"
        f"  ({chat['approximate_ratio_vs_floor']:.0f}x the floor;"
        f" {verdict} the {chat['approximate_goal_us']:g} us goal)"
    )
    print(f"    approximate + public keys:                {chat['approximate_public_keys_us']:8.2f} us")
    print(f"    approximate, new system prompt each time: {chat['approximate_new_system_prompt_us']:8.2f} us")
    if "tokenizer_us" in chat:
        print(
            f"    tokenizer mode ({chat['tokenizer_tokens']} tokens):"
            f"              {chat['tokenizer_us']:8.2f} us"
            f"  (of which BPE encode {chat['tokenizer_bpe_encode_us']:.2f} us)"
        )


def run(args: argparse.Namespace) -> int:
    if args.chat_only:
        return _run_chat_only(args)
    rng = np.random.default_rng(args.seed)
    ident = KeyIdentity(model_id="bench", namespace="tenant", block_size_tokens=args.block_size)
    norm = Normalizer(NormalizerConfig(), b"bench-secret")
    tokens = rng.integers(0, 150_000, size=args.tokens, dtype=np.uint32)
    as_list = tokens.tolist()
    root = norm.root(ident)
    keys_s = median_s(lambda: norm.keys_for_tokens(tokens, ident), args.repeats)
    from_list_s = median_s(lambda: norm.canonicalize("completions", {"prompt": as_list}, ident), args.repeats)
    per_token_s = median_s(
        lambda: _per_token_baseline(as_list, args.block_size, root), max(3, args.repeats // 5)
    )
    floor_s = median_s(lambda: xxhash.xxh3_64_intdigest(tokens.tobytes(), root), args.repeats)
    assert list(norm.keys_for_tokens(tokens, ident)) == _per_token_baseline(as_list, args.block_size, root)

    with tempfile.TemporaryDirectory() as tmp:
        trained = args.tokenizer_dir is None
        model_dir = (
            Path(args.tokenizer_dir) if not trained else train_tokenizer(Path(tmp), rng, args.vocab_size)
        )
        tnorm = Normalizer(NormalizerConfig(mode="tokenizer", tokenizer_dir=str(model_dir)), b"bench-secret")
        body = _chat_of_tokens(tnorm, rng, args.tokens)
        chat = canonicalize_chat(body, tnorm.config, b"k" * 32)
        tok = tnorm.chat_tokenizer  # the benchmark times the stages one by one
        assert tok is not None
        text = tok.render(chat)
        n_chat = len(tok.encode(text, add_special_tokens=False, with_offsets=False).tokens)
        render_s = median_s(lambda: tok.render(chat), max(3, args.repeats // 3))
        encode_s = median_s(
            lambda: tok.encode(text, add_special_tokens=False, with_offsets=False), max(3, args.repeats // 3)
        )
        total_s = median_s(lambda: tnorm.canonicalize("chat", body, ident), max(3, args.repeats // 3))
        chat_report = chat_request_report(args, model_dir)

    report = {
        "benchmark": "keys",
        "git_sha": git_sha(),
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
        "config": {
            "tokens": args.tokens,
            "block_size": args.block_size,
            "repeats": args.repeats,
            "seed": args.seed,
            "tokenizer": args.tokenizer_dir or f"trained byte-level BPE, vocab {args.vocab_size}",
        },
        "key_ms": keys_s * 1e3,
        "key_goal_ms": 2.0,
        "key_from_python_list_ms": from_list_s * 1e3,
        "baseline_per_token_packing_ms": per_token_s * 1e3,
        "floor_one_xxh3_ms": floor_s * 1e3,
        "speedup_vs_per_token": per_token_s / keys_s,
        "ratio_vs_floor": keys_s / floor_s,
        "chat_tokens": n_chat,
        "template_render_ms_per_1k_tokens": render_s * 1e3 / n_chat * 1000,
        "tokenize_ms_per_1k_tokens": encode_s * 1e3 / n_chat * 1000,
        "chat_canonicalize_total_ms": total_s * 1e3,
        "chat_request": chat_report,
    }
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0
    verdict = "meets" if keys_s * 1e3 < 2.0 else "MISSES"
    print(f"kvgate bench keys  (git {report['git_sha']}, seed {args.seed}, block {args.block_size})")
    print(f"  keys, {args.tokens} tokens (uint32 ids):   {keys_s * 1e3:8.3f} ms  ({verdict} the 2 ms goal)")
    print(f"  same, from a Python list + facade:  {from_list_s * 1e3:8.3f} ms")
    print(
        f"  baseline, per-token packing:        {per_token_s * 1e3:8.3f} ms"
        f"  (ours is {per_token_s / keys_s:.1f}x faster)"
    )
    print(
        f"  floor, one xxh3 over all bytes:     {floor_s * 1e3:8.3f} ms"
        f"  (ours is {keys_s / floor_s:.1f}x the floor)"
    )
    print(f"  chat prompt of {n_chat} tokens, tokenizer mode:")
    print(f"    template render:  {report['template_render_ms_per_1k_tokens']:.3f} ms per 1k tokens")
    print(f"    tokenization:     {report['tokenize_ms_per_1k_tokens']:.3f} ms per 1k tokens")
    print(f"    canonicalize end to end (render, tokenize, zones, keys): {total_s * 1e3:.1f} ms")
    print_chat_report(chat_report)
    print(orjson.dumps(report).decode())
    return 0


def _run_chat_only(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        trained = args.tokenizer_dir is None
        rng = np.random.default_rng(args.seed)
        model_dir = (
            Path(args.tokenizer_dir)
            if not trained
            else train_tokenizer(Path(tmp), rng, args.vocab_size, n_words=20_000)
        )
        chat_report = chat_request_report(args, model_dir)
    report = {
        "benchmark": "keys --chat-only",
        "git_sha": git_sha(),
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
        "config": {
            "block_size": args.block_size,
            "seed": args.seed,
            "normalizer": "demo (approximate mode, defaults)",
            "tokenizer": args.tokenizer_dir or f"trained byte-level BPE, vocab {args.vocab_size}",
        },
        "chat_request": chat_report,
    }
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(
        f"kvgate bench keys --chat-only  (git {report['git_sha']}, seed {args.seed}, block {args.block_size})"
    )
    print_chat_report(chat_report)
    print(orjson.dumps(report).decode())
    return 0
