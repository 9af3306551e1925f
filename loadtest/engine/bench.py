"""Engine speed: a synthetic trace replayed through N engines, step by step vs coalesced decode.

    python -m loadtest.engine.bench [--engines 8] [--requests 12000] [--mean-prompt 12000] [--seed 0]

Requests arrive as a Poisson process, share one of 50 long prefixes (2,000 blocks at most) and
have a private tail; each engine gets an equal share. Both runs replay the same requests; the
second passes the next arrival time as `until_s` so pure-decode steps are coalesced. Prints wall
time, engine steps and the hit ratio of each run, and the speed-up of the coalesced run.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from loadtest.engine import DEFAULT_PROFILE, Engine, EngineRequest, load_profile
from prompt_normalizer.bench import git_sha


@dataclass(frozen=True, slots=True)
class RunResult:
    wall_s: float
    steps: int
    hit_ratio: float
    virtual_end_s: float
    prompt_tokens: int


def make_trace(
    n_requests: int, mean_prompt: int, rate_per_s: float, block_size: int, seed: int
) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    t = 0.0
    out: list[tuple[float, EngineRequest]] = []
    for i in range(n_requests):
        t += rng.expovariate(rate_per_s)
        n_prompt = max(block_size, int(rng.uniform(0.2, 1.8) * mean_prompt))
        n_blocks = n_prompt // block_size
        shared = min(n_blocks, 2000)
        group = rng.randrange(50)
        hashes = [hash((group, j)) & (2**64 - 1) for j in range(shared)]
        hashes += [hash((seed, i, j)) & (2**64 - 1) for j in range(shared, n_blocks)]
        out.append((t, EngineRequest(i, n_prompt, rng.randint(50, 600), hashes)))
    return out


def replay(trace: list[tuple[float, EngineRequest]], profile_name: str, coalesce: bool) -> RunResult:
    profile = load_profile(profile_name)
    engine = Engine(profile)
    began = time.perf_counter()
    now = 0.0
    k = 0
    steps = 0
    while k < len(trace) or engine.has_work():
        if not engine.has_work():
            now = max(now, trace[k][0])
        while k < len(trace) and trace[k][0] <= now:
            engine.submit(trace[k][1])
            k += 1
        until = trace[k][0] if coalesce and k < len(trace) else (float("inf") if coalesce else None)
        res = engine.step(now, until)
        if res is None:
            continue
        steps += 1
        now = res.end_s
    stats = engine.stats()
    hit = stats.prefix_cache_hits_tokens / max(1, stats.prefix_cache_queries_tokens)
    return RunResult(time.perf_counter() - began, steps, hit, now, stats.prefix_cache_queries_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench", description=__doc__)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--mean-prompt", type=int, default=12000)
    parser.add_argument("--rate", type=float, default=3.3, help="arrivals per second, all engines")
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sha = git_sha()
    print(f"engines={args.engines} requests={args.requests} mean_prompt={args.mean_prompt} "
          f"rate={args.rate}/s profile={args.profile} seed={args.seed} git={sha}")  # fmt: skip
    per_engine = args.requests // args.engines
    totals: dict[bool, list[RunResult]] = {False: [], True: []}
    for e in range(args.engines):
        trace = make_trace(per_engine, args.mean_prompt, args.rate / args.engines, 16, args.seed * 1000 + e)
        for coalesce in (False, True):
            totals[coalesce].append(replay(trace, args.profile, coalesce))
    tokens = sum(r.prompt_tokens for r in totals[False])
    print(f"prompt tokens: {tokens / 1e6:.1f} M")
    print("| mode | wall s | engine steps | hit ratio | virtual end s |")
    print("|---|---:|---:|---:|---:|")
    for coalesce, label in ((False, "step by step"), (True, "coalesced decode")):
        rs = totals[coalesce]
        hit = sum(r.hit_ratio * r.prompt_tokens for r in rs) / max(1, tokens)
        print(f"| {label} | {sum(r.wall_s for r in rs):.1f} | {sum(r.steps for r in rs)} | {hit:.4f} | "
              f"{max(r.virtual_end_s for r in rs):.1f} |")  # fmt: skip
    speedup = sum(r.wall_s for r in totals[False]) / sum(r.wall_s for r in totals[True])
    print(f"coalesced / step-by-step speed-up: {speedup:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
