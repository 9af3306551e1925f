"""`kvgate bench overhead`: what a router in front of an instant backend costs, per request.

Every target forwards non-streaming chat to the same static backend (nginx when installed, else
`loadtest.static_backend`): the backend directly, kvgate (`python -m gateway.cli serve --config`)
with round_robin and with the `cost` policy, sglang-router (from its own venv, see
`loadtest/peers/install.sh`) with round_robin and cache_aware, smg 1.13 (its own venv too) with
cache_aware and prefix_hash, and, with `--upstream-clients`,
a minimal FastAPI pass-through proxy with an aiohttp and with an httpx upstream client. For each
target: req/s and p50/p99 latency at concurrency 32 and 1 (wrk when installed, else a built-in
aiohttp load generator), and the router process tree's CPU time (utime+stime from /proc) per
request. Ratios are against sglang-router and the direct run of the same invocation; when smg
cache_aware ran, a second CPU ratio is against it. A second table says where the cores went
during each run (router, backend, load generator, other jobs).

Here: the command line and the targets table. The targets are in `overhead_targets` (ours) and
`overhead_peers`; running and CPU accounting in `overhead_runner`; the tables in `overhead_report`;
the load generators and process handling in `overhead_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from loadtest.overhead_load import LoadResult, builtin_load, chat_bodies, run_wrk, stop, wrk_script
from loadtest.overhead_peers import proxy_target, sglang_target, smg_target
from loadtest.overhead_report import report
from loadtest.overhead_runner import BenchConfig, TargetResult, measure
from loadtest.overhead_targets import Target, direct_target, kvgate_target, start_backend
from prompt_normalizer.bench import git_sha

DEFAULT_TARGETS = (
    "direct",
    "kvgate-rr",
    "kvgate-cost",
    "sglang-rr",
    "sglang-cache_aware",
    "smg-cache_aware",
    "smg-prefix_hash",
)
# kvgate-cost-traced: `tracing.enabled`, every request sampled (needs the `kvgate[otel]` extra).
TARGET_CHOICES = (*DEFAULT_TARGETS, "kvgate-cost-traced")


def build_targets(
    names: Sequence[str], upstream_clients: bool, processes: Sequence[int] = (1,)
) -> list[Target]:
    table: dict[str, Callable[[int], Target]] = {
        "direct": lambda _n: direct_target(),
        "kvgate-rr": lambda n: kvgate_target("round_robin", "sglang-router round_robin", processes=n),
        "kvgate-cost": lambda n: kvgate_target("cost", "sglang-router cache_aware", processes=n),
        "kvgate-cost-traced": lambda n: kvgate_target("cost", "kvgate cost", traced=True, processes=n),
        "sglang-rr": lambda _n: sglang_target("round_robin"),
        "sglang-cache_aware": lambda _n: sglang_target("cache_aware"),
        "smg-cache_aware": lambda _n: smg_target("cache_aware"),
        "smg-prefix_hash": lambda _n: smg_target("prefix_hash"),
    }
    # A kvgate target runs once per `processes` value; the others once.
    targets = [table[name](n) for name in names for n in (processes if name.startswith("kvgate") else (1,))]
    if upstream_clients:
        targets += [proxy_target("aiohttp"), proxy_target("httpx")]
    return targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up seconds per target (default 1)")
    parser.add_argument("--concurrency", default="32,1", help="comma-separated concurrencies (default 32,1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request bodies (default 0)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all targets; medians (default 1)")
    parser.add_argument(
        "--backend",
        choices=("auto", "nginx", "builtin"),
        default="auto",
        help="static backend (default auto: nginx when installed)",
    )
    parser.add_argument(
        "--load-tool",
        choices=("auto", "wrk", "builtin"),
        default="auto",
        help="load generator (default auto: wrk when installed)",
    )
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated among {', '.join(TARGET_CHOICES)} (default: all but the last)",
    )
    parser.add_argument(
        "--upstream-clients",
        action="store_true",
        help="also measure pass-through proxies with aiohttp and httpx",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="streamed chat (the backend answers an event stream; without the pass-through proxies)",
    )
    parser.add_argument(
        "--processes",
        default="1",
        help="comma-separated gateway process counts for the kvgate targets (`kvgate serve --processes`)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    names = tuple(n.strip() for n in args.targets.split(",") if n.strip())
    unknown = [n for n in names if n not in TARGET_CHOICES]
    if unknown:
        print(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGET_CHOICES)}", file=sys.stderr)
        return 2
    try:
        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
        processes = tuple(int(n) for n in args.processes.split(","))
    except ValueError:
        print("--concurrency and --processes must be comma-separated integers", file=sys.stderr)
        return 2
    if not processes or min(processes) < 1 or max(processes) > 64:
        print("--processes values must be in 1..64", file=sys.stderr)
        return 2
    if not concurrencies or min(concurrencies) < 1 or max(concurrencies) > 1024:
        print("--concurrency values must be in 1..1024", file=sys.stderr)
        return 2
    if not 0 < args.duration <= 120 or not 0 <= args.warmup <= 60 or not 1 <= args.repeats <= 10:
        print("--duration must be in 1..120, --warmup in 0..60 and --repeats in 1..10", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = "nginx" if shutil.which("nginx") else "builtin"
    load_tool = args.load_tool
    if load_tool == "auto":
        load_tool = "wrk" if shutil.which("wrk") else "builtin"
    for tool, kind in ((backend, "nginx"), (load_tool, "wrk")):
        if tool == kind and not shutil.which(kind):
            print(
                f"{kind} is not installed (apt-get install -y {'nginx-light' if kind == 'nginx' else 'wrk'})"
            )
            return 2
    if args.stream and args.upstream_clients:
        print("--upstream-clients measures non-streamed pass-through proxies only", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        args.duration,
        args.warmup,
        concurrencies,
        args.seed,
        backend,
        load_tool,
        args.upstream_clients,
        names,
        args.repeats,
        args.stream,
    )
    bodies = chat_bodies(args.seed, stream=args.stream)
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-overhead-") as tmp:
        workdir = Path(tmp)
        script = workdir / "post_chat.lua"
        script.write_text(wrk_script(bodies))

        def load(url: str, c: int, dur: float) -> LoadResult:
            if load_tool == "wrk":
                return run_wrk(url, script, c, dur)
            return asyncio.run(builtin_load(url, bodies, c, dur))

        backend_proc, backend_url, backend_name = start_backend(backend, workdir, args.stream)
        targets = build_targets(names, args.upstream_clients, processes)
        results = [TargetResult(t.name, t.baseline) for t in targets]
        try:
            # Rounds interleave the targets, so slow drifts of a shared machine hit all of them.
            for round_index in range(cfg.repeats):
                for target, result in zip(targets, results, strict=True):
                    if result.missing is None:
                        print(f"round {round_index + 1}: {target.name} ...", file=sys.stderr, flush=True)
                        measure(target, (backend_url, backend_proc.pid), cfg, workdir, load, result)
        finally:
            stop(backend_proc)
    print(report(results, cfg, backend_name))
    if args.json is not None:
        payload = {
            "git_sha": git_sha(),
            "config": asdict(cfg),
            "backend": backend_name,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
