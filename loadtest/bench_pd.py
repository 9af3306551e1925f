"""`kvgate bench pd`: kvgate and smg `--pd-disaggregation` over HTTP, in front of the same P/D workers.

For each repeat, and in it for each router named in `--routers` (in turn): start P prefill and D
decode emulated workers speaking SGLang's bootstrap protocol (fresh, empty caches), start the
router in front of them, replay the same requests at the same arrival times, and read the prefill
workers' prefix-cache counters before and after. Then print one table of medians over the repeats
and write `report.md` and `results.json` into `--out`.

Routers: `kvgate:<policy>` (a P/D pool, `pd.protocol: sglang`, the policy picking the prefill
worker and the pair chooser the decode worker) and `smg:<prefill policy>` (smg 1.13 with
`--pd-disaggregation`, `--decode-policy` from `--smg-decode-policy`; its workers re-registered as
SGLang runtimes so that it sends `bootstrap_*`, see `loadtest.peers.launch`).

The hit ratio is the prefill workers' own (`vllm:prefix_cache_hits_total` over
`..._queries_total`, warm-up excluded): smg passes on the decode worker's `cached_tokens`, which
counts the received KV (prompt − 1), while kvgate reports the prefill worker's, so the client-side
figure ("reported") is not comparable between them. Ratios are taken within each repeat against
the first smg router, then their median is shown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from loadtest.bench_routing import (
    add_emulator_arguments,
    add_run_arguments,
    emulator_settings,
    load_requests,
    warmup_requests,
)
from loadtest.cli_args import UsageError, positive_float, positive_int, worker_split
from loadtest.peers.emulators import PdEmulatorPool
from loadtest.peers.kvgate import bench_api_key
from loadtest.peers.kvgate_pd import PdPool, build_kvgate_pd_command
from loadtest.peers.launch import (
    PeerCommand,
    PeerMissing,
    build_smg_pd_command,
    register_smg_sglang_workers,
    start_peer,
)
from loadtest.ports import free_port
from loadtest.report.meta import run_metadata
from loadtest.report.pd import aggregate, fmt, markdown_table
from loadtest.traces.http_replay import HttpResult, ReplayConfig, replay
from loadtest.traces.mooncake import TraceFormatError
from loadtest.workloads.records import WorkloadRequest
from loadtest.workloads.registry import WORKLOADS

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
FAILED = "vllm:nixl_num_failed_transfers"
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
COUNTERS = (HITS, QUERIES, FAILED, TRANSFERS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, help=f"synthetic workload ({', '.join(sorted(WORKLOADS))})")
    src.add_argument("--trace", metavar="FILE|NAME", help="a trace file or shipped trace name")
    parser.add_argument(
        "--workload-arg", action="append", default=[], metavar="K=V", help="workload option (repeatable)"
    )
    parser.add_argument("--users", type=positive_int, default=1, help="replay a trace as this many users")
    parser.add_argument("--max-requests", type=positive_int, default=200, help="only the first N requests")
    parser.add_argument("--rate-scale", type=positive_float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--pd", default="2:2", help="prefill:decode workers (default 2:2)")
    parser.add_argument(
        "--routers",
        default="kvgate:cost,smg:cache_aware,smg:prefix_hash",
        help="comma-separated: kvgate:<policy>, smg:<prefill policy>",
    )
    parser.add_argument(
        "--smg-decode-policy", default="power_of_two", help="smg --decode-policy (default power_of_two)"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of every router (default 3)")
    add_emulator_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument("--out", required=True, help="directory for report.md and results.json")
    parser.add_argument("--quiet", action="store_true", help="no line per run")


def parse_routers(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        name, _, policy = spec.partition(":")
        if name not in ("kvgate", "smg") or not policy:
            raise UsageError(f"router {spec!r}: expected kvgate:<policy> or smg:<prefill policy>")
    if not specs:
        raise UsageError("--routers names no router")
    return specs


@dataclass(slots=True)
class PdRun:
    """One router's turn in one repeat: what the client saw and the workers' counter deltas."""

    router: str
    repeat: int
    status: str = "ok"
    detail: str = ""
    results: list[HttpResult] = field(default_factory=list)
    prefill_queries: float = 0.0
    prefill_hits: float = 0.0
    failed_transfers: float = 0.0
    transfers: float = 0.0
    wall_s: float = 0.0


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def tpot_s(r: HttpResult) -> float | None:
    """Mean time per output token after the first (None for a one-token or failed answer)."""
    if r.error is not None or r.ttft_s is None or r.e2e_s is None or r.completion_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


def summarize_run(run: PdRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := tpot_s(r)) is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "router": run.router,
        "repeat": run.repeat,
        "status": run.status,
        "detail": run.detail,
        "n_sent": len(run.results),
        "n_errors": len(run.results) - len(ok),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p99_s": _pct(tpot, 99),
        "prefill_hit_ratio": run.prefill_hits / run.prefill_queries if run.prefill_queries else None,
        "reported_hit_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "failed_transfers": run.failed_transfers,
        # Requests whose decode worker received the KV: below 1, some ran without a split.
        "split_share": run.transfers / len(ok) if ok else None,
        "wall_s": run.wall_s,
    }


def parse_counters(text: str, names: Sequence[str] = COUNTERS) -> dict[str, float]:
    """The values of `names` in a Prometheus text exposition, summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name in names:
            value = rest.rsplit(" ", 1)[-1]
            if value != "NaN":
                out[name] = out.get(name, 0.0) + float(value)
    return out


async def _counters(urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        try:
            async with session.get(url + "/metrics") as resp:
                return parse_counters(await resp.text()) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError):
            return {}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        return list(await asyncio.gather(*(one(session, u) for u in urls)))


def _delta(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> float:
    return sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))


async def _measure(
    cmd: PeerCommand, pool: PdEmulatorPool, reqs: list[WorkloadRequest], args: argparse.Namespace, run: PdRun
) -> None:
    base = f"http://127.0.0.1:{cmd.port}"

    def headers_for(req: WorkloadRequest) -> dict[str, str]:
        return (
            {"Authorization": f"Bearer {bench_api_key(req.tenant)}"} if cmd.name.startswith("kvgate") else {}
        )

    n_warm = args.warmup_requests if args.warmup_requests is not None else len(pool.urls)
    warm = warmup_requests(reqs[0].tenant, n_warm)
    if warm:
        await replay(warm, ReplayConfig(base, args.model, time_limit_s=5.0, grace_s=60.0), headers_for)
    before = await _counters(pool.urls)
    cfg = ReplayConfig(
        base_url=base,
        model=args.model,
        time_scale=args.time_scale,
        max_in_flight=args.max_in_flight,
        time_limit_s=args.time_limit_s,
    )
    run.results = await replay(reqs, cfg, headers_for)
    after = await _counters(pool.urls)
    n_prefill = len(pool.prefill_urls)
    run.prefill_queries = _delta(before[:n_prefill], after[:n_prefill], QUERIES)
    run.prefill_hits = _delta(before[:n_prefill], after[:n_prefill], HITS)
    run.failed_transfers = _delta(before[n_prefill:], after[n_prefill:], FAILED)
    run.transfers = _delta(before[n_prefill:], after[n_prefill:], TRANSFERS)


def _command(
    spec: str, pool: PdEmulatorPool, reqs: list[WorkloadRequest], args: argparse.Namespace, workdir: Path
) -> PeerCommand:
    name, _, policy = spec.partition(":")
    if name == "kvgate":
        pd = PdPool(tuple(pool.prefill_urls), tuple(pool.decode_urls), "sglang", dict(pool.bootstrap_ports))
        return build_kvgate_pd_command(
            policy=policy,
            port=free_port(),
            pd=pd,
            model=args.model,
            tenants=sorted({r.tenant for r in reqs}),
            seed=args.seed,
            workdir=workdir,
        )
    return build_smg_pd_command(
        port=free_port(),
        metrics_port=free_port(),
        prefill=[(u, pool.bootstrap_ports[u]) for u in pool.prefill_urls],
        decode_urls=pool.decode_urls,
        prefill_policy=policy,
        # smg refuses power_of_two over a single decode worker
        decode_policy="round_robin" if len(pool.decode_urls) < 2 else args.smg_decode_policy,
    )


def run_router(
    spec: str, repeat: int, reqs: list[WorkloadRequest], args: argparse.Namespace, out: Path
) -> PdRun:
    """One router's turn on fresh workers; never raises for a router that cannot run."""
    run = PdRun(spec, repeat)
    workdir = out / "logs" / f"r{repeat}" / spec.replace(":", "_")
    n_prefill, n_decode = worker_split(args.pd)
    settings = emulator_settings(args)
    started = time.monotonic()
    try:
        pool = PdEmulatorPool(n_prefill, n_decode, settings, workdir)
    except (RuntimeError, TimeoutError) as exc:
        return PdRun(spec, repeat, "failed", f"emulated workers did not start: {str(exc)[-300:]}")
    router = None
    try:
        try:
            cmd = _command(spec, pool, reqs, args, workdir)
        except PeerMissing as exc:
            return PdRun(spec, repeat, "missing", str(exc))
        try:
            router = start_peer(cmd, workdir=workdir, ready_timeout_s=60.0)
            if not cmd.name.startswith("kvgate"):
                register_smg_sglang_workers(f"http://127.0.0.1:{cmd.port}", pool.bootstrap_ports)
        except (RuntimeError, TimeoutError, OSError) as exc:
            return PdRun(spec, repeat, "failed", f"did not start: {str(exc)[-300:]}")
        asyncio.run(_measure(cmd, pool, reqs, args, run))
    finally:
        if router is not None:
            router.stop()
        pool.stop()
        run.wall_s = time.monotonic() - started
    return run


def _progress(s: dict[str, Any]) -> str:
    if s["status"] != "ok":
        return f"r{s['repeat']} {s['router']:24s} {s['status']}: {s['detail']}"
    return (
        f"r{s['repeat']} {s['router']:24s} ttft p50 {fmt(s['ttft_p50_s'], '.3f')} "
        f"p99 {fmt(s['ttft_p99_s'], '.3f')}  "
        f"tpot p99 {fmt(s['tpot_p99_s'], '.1f', 1e3)}ms  prefill hit {fmt(s['prefill_hit_ratio'], '.3f')}  "
        f"split {fmt(s['split_share'], '.3f')}  errors {s['n_errors']}/{s['n_sent']}  ({s['wall_s']:.0f}s)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        worker_split(args.pd)
        routers = parse_routers(args.routers)
        reqs = load_requests(args)
    except (UsageError, ValueError, TraceFormatError) as exc:
        print(f"kvgate bench pd: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any]] = []
    for repeat in range(1, args.repeats + 1):
        for spec in routers:
            summary = summarize_run(run_router(spec, repeat, reqs, args, out))
            summaries.append(summary)
            if not args.quiet:
                print(_progress(summary), file=sys.stderr, flush=True)
    table, ref = aggregate(summaries, routers)
    meta = {**run_metadata(), "load_average": [round(x, 2) for x in os.getloadavg()]}
    config = {
        **meta,
        "source": args.trace or f"workload:{args.workload or 'gsp'}",
        "workload_args": args.workload_arg,
        "n_requests": len(reqs),
        "pd": args.pd,
        "protocol": "sglang",
        "smg_decode_policy": args.smg_decode_policy,
        "profile": args.profile,
        "kv_blocks": args.kv_blocks,
        "time_scale": args.time_scale,
        "rate_scale": args.rate_scale,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    header = (
        f"kvgate bench pd  git {meta['git_sha']}  {args.pd} (SGLang bootstrap)  {len(reqs)} requests  "
        f"{args.repeats} repeats, medians  load average {' '.join(map(str, meta['load_average']))}"
    )
    text = header + "\n\n" + markdown_table(table, ref)
    print(text)
    (out / "report.md").write_text(text + "\n")
    doc = {"config": config, "table": table, "runs": summaries}
    (out / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    ok = all(s["status"] == "ok" for s in summaries if s["router"].startswith("kvgate"))
    return 0 if ok else 1
