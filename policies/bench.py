"""`kvgate bench decision`: routing decision latency (index lookup + scoring) over many workers.

The index is filled first: a background of unrelated prompts on every worker, plus the measured
prompt's prefix on a few workers at different depths (so the lookup walks the whole prompt and
several workers drop out along the way). `--miss` times a prompt no worker holds instead: the
decision then weighs every worker's queue, not the holders'. Each policy's `select` is then timed
on the same request and worker views; round_robin, timed in the same run, is the baseline.
`--changed-views K` hands K of the views over as new objects before each decision, as a gateway
does for the workers whose counters moved since its last decision (`cost` re-reads only those).
`--prefill-progress X` times `cost` with that `prefill_progress` (`CostModel.prefill_remaining`):
every worker with a backlog then carries the time it started, up to a second before the timed
decisions, so most backlogs have drained in part and some wholly.
`--pd-holder` also times `cost` as a `pd.mode: holder_prefill` pool decides with it
(`policies.pd.PdRouter`, the row `cost+holder_prefill`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import xxhash

from policies.base import Observation, RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.cost_params import CostModelParams
from policies.index import IndexConfig
from policies.pd import HOLDER_PREFILL, PdRouter, PdSettings
from policies.pools import PoolSettings
from policies.prefix_policy import SharedSettings
from policies.registry import make_policy
from prompt_normalizer.bench import git_sha
from prompt_normalizer.types import BlockKey

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-decision latency of one policy on one prompt size, in microseconds."""

    policy: str
    prompt_tokens: int
    median_us: float
    p99_us: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="workers per decision (default 64)")
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[2048, 32768], help="prompt sizes to time"
    )
    parser.add_argument("--repeats", type=int, default=400, help="timed decisions per policy and size")
    parser.add_argument("--background-prompts", type=int, default=2000, help="unrelated prompts in the index")
    parser.add_argument(
        "--granularity-blocks", type=int, default=1, help="blocks per prefix-index entry (default 1)"
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["round_robin", "cost", "sglang_cache_aware", "preble_e2", "consistent_hash", "least_load"],
        help="registered policies to time",
    )
    parser.add_argument(
        "--miss",
        action="store_true",
        help="time a prompt no worker holds (a new conversation) instead of one six workers hold in part",
    )
    parser.add_argument(
        "--changed-views",
        type=int,
        default=0,
        help="views replaced by new (equal) objects before each decision, as a gateway's registry hands"
        " out a new view for each worker whose counters moved (default 0)",
    )
    parser.add_argument(
        "--prefill-progress",
        type=float,
        default=0.0,
        help="the cost model's prefill_progress for `cost` (default 0: backlogs stay whole); above 0 the"
        " views' backlogs carry when they started",
    )
    parser.add_argument(
        "--pd-holder",
        action="store_true",
        help="also time `cost` through the pd.mode holder_prefill chooser (row cost+holder_prefill)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated keys (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _keys(rng: random.Random, n_blocks: int) -> tuple[BlockKey, ...]:
    prev = rng.getrandbits(64)
    out = []
    for i in range(n_blocks):
        prev = xxhash.xxh3_64_intdigest(i.to_bytes(4, "little"), seed=prev)
        out.append(BlockKey(prev))
    return tuple(out)


def _request(rid: str, keys: tuple[BlockKey, ...]) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        pool="bench",
        tenant="t",
        namespace="t",
        block_keys=keys,
        n_prompt_tokens=len(keys) * BLOCK + 7,
        block_size_tokens=BLOCK,
    )


def _views(rng: random.Random, n: int) -> list[WorkerView]:
    return [
        WorkerView(
            WorkerId(f"http://10.0.{i // 256}.{i % 256}:8000"),
            in_flight_requests=rng.randint(0, 12),
            in_flight_prefill_tokens=(prefill := rng.randint(0, 40_000)),
            in_flight_prefill_pairs=rng.randint(0, prefill * prefill // 2),
            in_flight_decode_tokens=rng.randint(0, 200_000),
            num_requests_waiting=rng.randint(0, 4),
            num_requests_running=rng.randint(0, 12),
            num_gpu_blocks=27_000,
            engine_block_size=BLOCK,
        )
        for i in range(n)
    ]


def _started(seed: int, views: Sequence[WorkerView]) -> list[WorkerView]:
    """`views` with each backlog's start (`WorkerView.prefill_started_s`) up to a second before
    the timed decisions (at 1.0), drawn apart from the views so that their other fields stay the
    same."""
    rng = random.Random(seed + 3)
    return [
        dataclasses.replace(w, prefill_started_s=rng.uniform(0.0, 1.0))
        if w.in_flight_prefill_tokens > 0
        else w
        for w in views
    ]


def _fill(
    policy: RoutingPolicy, views: Sequence[WorkerView], prompt: RouteRequest, args: argparse.Namespace
) -> None:
    rng = random.Random(args.seed + 1)
    for i in range(args.background_prompts):
        r = _request(f"bg{i}", _keys(rng, rng.randint(8, 256)))
        d = policy.select(r, views, 0.0)
        if d is not None:
            policy.on_dispatch(r, d, 0.0)
            policy.on_complete(Observation(r, d.worker, prompt_tokens=r.n_prompt_tokens), 0.0)
    # The measured prompt's prefix on six workers, from a quarter of it to all of it.
    n = len(prompt.block_keys)
    for j, frac in enumerate((0.25, 0.5, 0.6, 0.75, 0.9, 1.0)):
        part = _request(f"warm{j}", prompt.block_keys[: max(1, int(n * frac))])
        target = views[(j * 7) % len(views)]
        d = policy.select(part, [target], 0.0)
        if d is not None:
            policy.on_dispatch(part, d, 0.0)
            policy.on_complete(Observation(part, d.worker, prompt_tokens=part.n_prompt_tokens), 0.0)


Decide = Callable[[RouteRequest, Sequence[WorkerView], float], object]


def _time(
    decide: Decide, prompt: RouteRequest, views: Sequence[WorkerView], repeats: int, changed: int = 0
) -> list[float]:
    for _ in range(min(50, repeats)):
        decide(prompt, views, 1.0)
    samples = []
    clock = time.perf_counter_ns
    views = list(views)
    rng = random.Random(len(views))
    changed = min(changed, len(views))
    # Like timeit: collect first and keep the collector out of the timed loop.
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            # New objects with the same fields: a policy that keeps what it read from a view must
            # read these again, and every decision stays the same.
            for i in rng.sample(range(len(views)), changed):
                views[i] = dataclasses.replace(views[i])
            t0 = clock()
            decide(prompt, views, 1.0)
            samples.append((clock() - t0) / 1000.0)
    finally:
        gc.enable()
    return samples


def measure(args: argparse.Namespace) -> list[Timing]:
    results = []
    for tokens in args.prompt_tokens:
        rng = random.Random(args.seed)
        views = _views(rng, args.workers)
        if args.prefill_progress > 0:
            views = _started(args.seed, views)
        prompt = _request("measured", _keys(rng, tokens // BLOCK))
        for name in args.policies:
            options: dict[str, object] = {}
            if name in ("cost", "preble_e2"):
                index = IndexConfig(granularity_blocks=args.granularity_blocks)
                cost = CostModelParams(prefill_progress=args.prefill_progress if name == "cost" else 0.0)
                options["shared"] = SharedSettings(default_pool=PoolSettings(index=index, cost=cost))
            policy = make_policy(name, seed=args.seed, **options)
            _fill(policy, views, prompt, args)
            measured = (
                _request("new", _keys(random.Random(args.seed + 2), len(prompt.block_keys)))
                if args.miss
                else prompt
            )
            rows: list[tuple[str, Decide]] = [(name, policy.select)]
            if name == "cost" and args.pd_holder:
                router = PdRouter(PdSettings(mode=HOLDER_PREFILL))
                rows.append((f"{name}+holder_prefill", partial(router.select, policy)))
            for label, decide in rows:
                samples = sorted(_time(decide, measured, views, args.repeats, args.changed_views))
                p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
                results.append(Timing(label, prompt.n_prompt_tokens, statistics.median(samples), p99))
    return results


def run(args: argparse.Namespace) -> int:
    if (
        args.workers < 1
        or args.repeats < 1
        or args.changed_views < 0
        or not 0.0 <= args.prefill_progress <= 1.0
        or any(t < BLOCK for t in args.prompt_tokens)
    ):
        print(
            "need --workers >= 1, --repeats >= 1, --changed-views >= 0, --prefill-progress in [0, 1]"
            " and prompts of at least one block",
            file=sys.stderr,
        )
        return 2
    results = measure(args)
    config = {
        "workers": args.workers,
        "repeats": args.repeats,
        "background_prompts": args.background_prompts,
        "granularity_blocks": args.granularity_blocks,
        "seed": args.seed,
        "miss": args.miss,
        "changed_views": args.changed_views,
        **({"prefill_progress": args.prefill_progress} if args.prefill_progress > 0 else {}),
        **({"pd_holder": True} if args.pd_holder else {}),
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
    }
    base = {r.prompt_tokens: r.median_us for r in results if r.policy == "round_robin"}
    if args.json:
        rows = [
            {
                "policy": r.policy,
                "prompt_tokens": r.prompt_tokens,
                "median_us": round(r.median_us, 2),
                "p99_us": round(r.p99_us, 2),
                "x_round_robin": round(r.median_us / base[r.prompt_tokens], 2)
                if r.prompt_tokens in base
                else None,
            }
            for r in results
        ]
        print(json.dumps({"config": config, "results": rows}, indent=2))
        return 0
    print("decision latency: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    print(f"{'policy':<20} {'prompt':>7} {'median µs':>10} {'p99 µs':>9} {'× round_robin':>14}")
    for r in results:
        ratio = f"{r.median_us / base[r.prompt_tokens]:.1f}" if r.prompt_tokens in base else "-"
        print(f"{r.policy:<20} {r.prompt_tokens:>7} {r.median_us:>10.1f} {r.p99_us:>9.1f} {ratio:>14}")
    return 0
