"""`kvgate bench routing`: kvgate and the peer routers over HTTP, in front of the same emulated workers.

For each router named in `--routers` (in turn): start N fresh emulated workers (empty caches),
start the router in front of them, replay the same requests at the same arrival times over HTTP
(bounded concurrency and total time), sample per-worker load from the workers' /metrics, stop
everything by PID. Then write `report.md`, `results.json` and PNG plots into `--out`.

Router names: `kvgate:<policy>` (any registered policy; `kvgate:<policy>+holder_prefill` gives
the pool a vLLM `pd` section in that mode, docs/pd.md, and `+holder_prefill@S` sets its
`holder_share` to S), `sglang-router[:policy]`,
`vllm-router[:policy]`, `litellm[:routing_strategy]`, `smg[:policy]` (smg 1.13: cache_aware by
default, or prefix_hash, round_robin, ...). A peer that is not installed is reported as
missing (see `loadtest/peers/install.sh`). Ratios in the report are against the first router that
ran (the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson
import yaml

from loadtest.cli_args import positive_float, positive_int
from loadtest.peers.emulators import EmulatorPool, EmulatorSettings
from loadtest.peers.kvgate import bench_api_key, build_kvgate_command
from loadtest.peers.launch import (
    LITELLM_MASTER_KEY,
    PEERS,
    PeerCommand,
    PeerMissing,
    build_command,
    start_peer,
)
from loadtest.ports import free_port
from loadtest.report.meta import run_metadata
from loadtest.report.progress import ProgressBar
from loadtest.report.routing import RouterRun, markdown_report, router_summary
from loadtest.report.sampler import LoadSample, sample_load, scrape
from loadtest.traces.http_replay import HttpResult, ReplayConfig, replay
from loadtest.traces.load import load_trace
from loadtest.traces.mooncake import TraceFormatError
from loadtest.workloads.ceilings import ceiling_infinite, ceiling_pooled_lru
from loadtest.workloads.records import ChatPrompt, TextPrompt, WorkloadRequest, scale_arrivals
from loadtest.workloads.registry import WORKLOADS, make_workload
from loadtest.workloads.text import synth_text

DECISIONS_FILE = "decisions.jsonl"  # a kvgate router's decision log, in its logs/ directory
WARMUP_PREFIX = "warmup-"  # request ids of the unmeasured warm-up requests
DEFAULT_KV_BLOCKS = 27000  # the default profile's pool; used for the pooled-LRU ceiling when not given


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The request stream's options (also `kvgate bench replicas`'); `load_requests` reads them."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, help=f"synthetic workload ({', '.join(sorted(WORKLOADS))})")
    src.add_argument(
        "--trace",
        metavar="FILE|NAME",
        help="Mooncake .jsonl or kv-cache-tester .json trace (plain, .gz or .xz), or a shipped trace: "
        "mooncake-conversation, mooncake-synthetic, kvct-agent",
    )
    parser.add_argument(
        "--workload-arg", action="append", default=[], metavar="K=V", help="workload option (repeatable)"
    )
    parser.add_argument(
        "--users", type=positive_int, default=1, help="replay a trace as this many salted users"
    )
    parser.add_argument("--max-requests", type=positive_int, default=200, help="only the first N requests")
    parser.add_argument(
        "--rate-scale", type=positive_float, default=1.0, help="multiply the arrival rate by X"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--routers", default="kvgate:round_robin,sglang-router", help="comma-separated routers to compare"
    )
    parser.add_argument("--workers", type=positive_int, default=4, help="emulated workers (default 4)")
    add_emulator_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument(
        "--sample-interval-s", type=positive_float, default=0.5, help="per-worker load sampling period"
    )
    parser.add_argument("--out", required=True, help="directory for report.md, results.json and plots")
    parser.add_argument(
        "--decision-log",
        action="store_true",
        help="kvgate routers log each routing decision to logs/<router>/decisions.jsonl "
        "(for `kvgate bench replay`)",
    )
    parser.add_argument(
        "--kvgate-policy-config",
        metavar="FILE",
        default=None,
        help="policy YAML whose options the kvgate routers run with (its `policy` is each row's)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    seed_help: str = "seed of workload and emulators (default 0)",
    in_flight_help: str = "client concurrency bound",
    warmup: bool = True,
) -> None:
    """How one run sends its workload (also `kvgate bench replicas`' and `kvgate bench pd`'s)."""
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument("--max-in-flight", type=positive_int, default=128, help=in_flight_help)
    parser.add_argument(
        "--time-limit-s", type=positive_float, default=120.0, help="stop sending after this long"
    )
    if warmup:
        parser.add_argument(
            "--warmup-requests",
            type=int,
            default=None,
            help="unmeasured requests first (default: one per worker)",
        )


def emulator_settings(args: argparse.Namespace) -> EmulatorSettings:
    """The emulated workers' settings from `add_emulator_arguments`' options and `--seed`."""
    return EmulatorSettings(
        model=args.model,
        profile=args.profile,
        kv_blocks=args.kv_blocks,
        time_scale=args.time_scale,
        seed=args.seed,
    )


def add_emulator_arguments(parser: argparse.ArgumentParser) -> None:
    """How the emulated workers run (also `kvgate bench replicas`' and `kvgate bench pd`'s)."""
    parser.add_argument("--profile", default=None, help="emulator step-time profile (default: its own)")
    parser.add_argument(
        "--kv-blocks", type=positive_int, default=None, help="KV blocks per worker (default: profile)"
    )
    parser.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="emulator model seconds per real second"
    )
    parser.add_argument("--model", default="emulated-llama", help="served model name")


def load_requests(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The first `--max-requests` of the trace or workload, by arrival, rate-scaled (also what
    `kvgate bench replay` rebuilds and `kvgate bench replicas` sends)."""
    if args.trace:
        reqs = list(load_trace(args.trace, users=args.users, seed=args.seed).requests)
    else:
        reqs = make_workload(args.workload or "gsp", args.seed, args.workload_arg)
    reqs = sorted(reqs, key=lambda r: r.arrival_s)[: args.max_requests]
    if args.rate_scale != 1.0:
        reqs = scale_arrivals(reqs, args.rate_scale)
    if not reqs:
        raise ValueError("no requests to replay")
    return reqs


def warmup_request(i: int, tenant: str) -> WorkloadRequest:
    """The `i`th unmeasured warm-up request (its id starts with `WARMUP_PREFIX`); `kvgate bench
    replay` rebuilds them too, since they are part of what the policy learned from.

    32 tokens: too few for `cost` to calibrate its prefill rate on (it needs 64 new tokens), since
    a first request's TTFT is mostly connection and start-up time, not prefill."""
    return WorkloadRequest(
        f"{WARMUP_PREFIX}{i}", 0.0, tenant, "warmup", TextPrompt(synth_text(f"warmup/{i}", 32)), 2
    )


def _router_command(
    spec: str, args: argparse.Namespace, urls: list[str], tenants: list[str], workdir: Path
) -> PeerCommand:
    name, _, policy = spec.partition(":")
    port = free_port()
    if name == "kvgate":
        policy, _, pd_spec = policy.partition("+")
        pd_mode, _, share = pd_spec.partition("@")
        return build_kvgate_command(
            policy=policy or "round_robin",
            port=port,
            worker_urls=urls,
            model=args.model,
            tenants=tenants,
            seed=args.seed,
            workdir=workdir,
            decision_log=workdir / DECISIONS_FILE if args.decision_log else None,
            pd_mode=pd_mode or None,
            pd_holder_share=float(share) if share else None,
            policy_options=_policy_options(args.kvgate_policy_config),
        )
    return build_command(
        name,
        port=port,
        metrics_port=free_port(),
        worker_urls=urls,
        model=args.model,
        policy=policy or None,
        workdir=workdir,
    )


def _policy_options(path: str | None) -> dict[str, object]:
    """The options of `--kvgate-policy-config` (everything but `policy`), or none."""
    if path is None:
        return {}
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a policy file is a mapping")
    return {k: v for k, v in doc.items() if k != "policy"}


def _headers(cmd: PeerCommand) -> Callable[[WorkloadRequest], dict[str, str]]:
    def headers_for(req: WorkloadRequest) -> dict[str, str]:
        if cmd.name.startswith("kvgate"):
            # The request id ties kvgate's decision log to the workload's request stream.
            return {"Authorization": f"Bearer {bench_api_key(req.tenant)}", "x-request-id": req.request_id}
        if cmd.api_key:
            return {"Authorization": f"Bearer {LITELLM_MASTER_KEY}"}
        return {}

    return headers_for


def warmup_requests(tenant: str, n: int) -> list[WorkloadRequest]:
    """`n` short requests with prompts of their own (no prefix of the workload's), all due at once."""
    return [warmup_request(i, tenant) for i in range(n)]


async def _measure(
    cmd: PeerCommand, urls: list[str], reqs: list[WorkloadRequest], args: argparse.Namespace, run: RouterRun
) -> None:
    cfg = ReplayConfig(
        base_url=f"http://127.0.0.1:{cmd.port}",
        model=args.model,
        time_scale=args.time_scale,
        max_in_flight=args.max_in_flight,
        time_limit_s=args.time_limit_s,
    )
    # Unmeasured warm-up with prompts of their own: connection pools, lazy imports and first-request
    # set-up of every router are paid before the clock starts, without touching the workload's prefixes.
    n_warm = args.warmup_requests if args.warmup_requests is not None else args.workers
    warm = warmup_requests(reqs[0].tenant, n_warm)
    if warm:
        await replay(
            warm, ReplayConfig(cfg.base_url, cfg.model, time_limit_s=5.0, grace_s=60.0), _headers(cmd)
        )
    stop = asyncio.Event()
    samples: list[LoadSample] = []
    sampler = asyncio.create_task(sample_load(urls, args.sample_interval_s, stop, samples))
    bar = None if args.quiet else ProgressBar(len(reqs), f"{run.name:24s}")
    try:
        results: list[HttpResult] = await replay(reqs, cfg, _headers(cmd), bar.update if bar else None)
    finally:
        stop.set()
        await sampler
        if bar:
            bar.close()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        final = await asyncio.gather(*(scrape(session, u) for u in urls))
    run.results = results
    run.load = samples
    run.worker_prompt_tokens = [m.get("vllm:prefix_cache_queries_total", 0.0) if m else 0.0 for m in final]
    run.worker_hit_tokens = [m.get("vllm:prefix_cache_hits_total", 0.0) if m else 0.0 for m in final]


def run_router(spec: str, reqs: list[WorkloadRequest], args: argparse.Namespace, out: Path) -> RouterRun:
    """One router's turn on a fresh pool of workers; never raises for a router that cannot run."""
    run = RouterRun(spec, "ok")
    workdir = out / "logs" / spec.replace(":", "_")
    workdir.mkdir(parents=True, exist_ok=True)
    settings = emulator_settings(args)
    try:
        pool = EmulatorPool(args.workers, settings, workdir)
    except (RuntimeError, TimeoutError) as exc:
        return RouterRun(spec, "failed", f"emulated workers did not start: {str(exc)[-300:]}")
    router = None
    started = time.monotonic()
    try:
        try:
            cmd = _router_command(spec, args, pool.urls, sorted({r.tenant for r in reqs}), workdir)
        except PeerMissing as exc:
            return RouterRun(spec, "missing", str(exc))
        except ValueError as exc:
            return RouterRun(spec, "failed", str(exc))
        try:
            router = start_peer(cmd, workdir=workdir, ready_timeout_s=60.0)
        except (RuntimeError, TimeoutError) as exc:
            return RouterRun(spec, "failed", f"did not start: {str(exc)[-300:]}")
        asyncio.run(_measure(cmd, pool.urls, reqs, args, run))
    finally:
        if router is not None:
            router.stop()
        pool.stop()
        run.wall_s = time.monotonic() - started
    return run


def run(args: argparse.Namespace) -> int:
    from loadtest.report.plots import hit_ratio_bars, load_over_time, ttft_cdf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        reqs = load_requests(args)
    except (ValueError, TraceFormatError) as exc:
        print(f"kvgate bench routing: error: {exc}", file=sys.stderr)
        return 2
    specs = [s.strip() for s in args.routers.split(",") if s.strip()]
    for spec in specs:
        name = spec.partition(":")[0]
        if name != "kvgate" and name not in PEERS:
            print(
                f"kvgate bench routing: unknown router {name!r}; known: kvgate, {', '.join(PEERS)}",
                file=sys.stderr,
            )
            return 2
    from loadtest.simulator.keys import KeyPath

    keys = KeyPath(model=args.model)  # strict tenants, as kvgate runs them here
    chains = [keys.keyed(r).chain() for r in reqs]
    kv_blocks = args.kv_blocks or DEFAULT_KV_BLOCKS
    ceilings = {
        "infinite": ceiling_infinite(chains).hit_ratio,
        "pooled_lru": ceiling_pooled_lru(chains, args.workers * kv_blocks * 16).hit_ratio,
    }
    runs = [run_router(spec, reqs, args, out) for spec in specs]
    summaries = {r.name: router_summary(r) for r in runs}
    ok = [r for r in runs if r.status == "ok"]
    baseline = ok[0].name if ok else None
    config = {
        **run_metadata(),
        "source": args.trace or f"workload:{args.workload or 'gsp'}",
        "workload": args.workload,
        "trace": args.trace,
        "users": args.users,
        "model": args.model,
        "workload_args": args.workload_arg,
        "n_requests": len(reqs),
        "n_chat": sum(isinstance(r.prompt, ChatPrompt) for r in reqs),
        "workers": args.workers,
        "profile": args.profile,
        "kv_blocks": args.kv_blocks,
        "time_scale": args.time_scale,
        "rate_scale": args.rate_scale,
        "max_requests": args.max_requests,
        "max_in_flight": args.max_in_flight,
        "time_limit_s": args.time_limit_s,
        "seed": args.seed,
    }
    doc = {
        "config": config,
        "ceilings": ceilings,
        "baseline": baseline,
        "routers": summaries,
        "requests": {r.name: r.results for r in runs},
        "load": {r.name: r.load for r in runs},
    }
    (out / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plotted = ttft_cdf(
        {r.name: [x.ttft_s for x in r.results if x.ttft_s is not None] for r in ok}, out / "ttft_cdf.png"
    )
    hit_ratio_bars(
        {r.name: summaries[r.name]["hit_ratio"] or 0.0 for r in ok},
        ceilings["infinite"],
        ceilings["pooled_lru"],
        out / "hit_ratio.png",
    )
    load_over_time({r.name: r.load for r in ok}, args.workers, out / "load_over_time.png")
    report = markdown_report(config, summaries, ceilings, baseline, plots=plotted)
    (out / "report.md").write_text(report)
    print(report)
    return 0 if ok else 1
