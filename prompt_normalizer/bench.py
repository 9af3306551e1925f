"""`kvgate bench keys`: block-key time of a long prompt, and tokenization time, on this machine.

Key time is measured on token ids that are already a uint32 array (what the tokenizer or the render
endpoint hands over), against two baselines timed in the same run: a per-token Python packing of
each block (what the vectorized view avoids) and one xxh3 call over the whole buffer (the floor).
Tokenization (chat-template rendering and BPE encoding) is timed separately, per 1k tokens, with
`--tokenizer-dir` or with a byte-level BPE trained here from seeded synthetic text.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import xxhash

from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

BENCH_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=32_768, help="prompt length in tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=31, help="timed repeats (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", help="a model dir (tokenizer.json + tokenizer_config.json)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="vocab of the BPE trained when no dir")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")


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


def train_tokenizer(directory: Path, rng: np.random.Generator, vocab_size: int) -> Path:
    """A byte-level BPE trained on seeded synthetic text, saved with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = synthetic_words(rng, 120_000)
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


def run(args: argparse.Namespace) -> int:
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
        from prompt_normalizer.canonical import canonicalize_chat

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
    print(orjson.dumps(report).decode())
    return 0
