"""`kvgate bench replicas`: do K gateway processes in front of the same workers route as one?

Each round runs, in turn and each on fresh emulated workers (empty caches): one `kvgate serve`
(the baseline), then K gateway processes for every `--sync` mode: `none` (independent replicas)
and `broker` (replica sync through a local nats-server). The same request stream (a workload or a
trace, the options of `kvgate bench routing`) is replayed at the same arrival times through a
client that is its own L4 balancer: `--max-in-flight` keep-alive connections spread round-robin
over the gateways' ports (`--front rr`, K separate `kvgate serve`), or all to one port served by
`kvgate serve --processes K` (`--front reuseport`: the kernel spreads the connections; that
command always shares, so only `--sync broker`). The same client, with the same connections, serves
the baseline.

Printed per configuration: the hit ratio (sum of `usage.prompt_tokens_details.cached_tokens` over
sum of `prompt_tokens`, answered requests), TTFT p50 and p99, each the median over `--repeats`
rounds, and each one's ratio to the one-process run: the median over rounds of the ratio to the
baseline of the same round; and per round, the gateways' home-share choices and holds
(`policies.herd`: decisions that went to a gateway's home share, and requests held before their
decision, because peers' same-instant dispatches were common).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.bench_routing import (
    add_emulator_arguments,
    add_run_arguments,
    add_workload_arguments,
    emulator_settings,
    load_requests,
    warmup_requests,
)
from loadtest.cli_args import positive_int
from loadtest.peers.emulators import EmulatorPool
from loadtest.peers.kvgate import bench_api_key
from loadtest.peers.launch import RunningProcess
from loadtest.replica_fleet import FleetSpec, metric_sum, start_broker, start_fleet
from loadtest.report.meta import run_metadata
from loadtest.report.routing import RouterRun, router_summary
from loadtest.traces.http_replay import ReplayConfig, replay
from loadtest.traces.mooncake import TraceFormatError
from loadtest.workloads.records import WorkloadRequest

# broker-shared-calibration: as `broker`, and the calibration samples too (sync.share_calibration).
SYNC_MODES = ("none", "broker", "broker-shared-calibration")
METRICS = ("hit_ratio", "ttft_p50_s", "ttft_p99_s")
BASELINE = "1 process"
# Per round, read from the gateways' metrics: what `policies.herd` did (a summary key per event).
HERD_EVENTS = {
    "home_choices": 'kvgate_policy_events_total{event="herd_home_choices"',
    "holds": 'kvgate_policy_events_total{event="herd_holds"',
}


@dataclass(frozen=True, slots=True)
class Setup:
    """One configuration of a round: its name, the fleet layout and whether it shares."""

    name: str
    layout: str
    processes: int
    sync: str


@dataclass(slots=True)
class Rounds:
    """A configuration's summaries, one per round (None for a round that failed)."""

    setup: Setup
    summaries: list[dict[str, Any] | None] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--gateways", type=positive_int, default=4, help="gateway processes K (default 4)")
    parser.add_argument(
        "--front",
        choices=("rr", "reuseport"),
        default="rr",
        help="rr: K `kvgate serve` on K ports, the client spreads connections round-robin; "
        "reuseport: `kvgate serve --processes K` on one port (sync broker only)",
    )
    parser.add_argument(
        "--sync",
        default="none,broker",
        help="comma-separated sync modes for the K processes: none, broker, broker-shared-calibration "
        "(also the cost model's calibration samples: sync.share_calibration)",
    )
    parser.add_argument("--policy", default="cost", help="routing policy of every gateway (default cost)")
    parser.add_argument(
        "--policy-file",
        type=Path,
        default=None,
        help="a policy YAML for every gateway instead of --policy (its seed becomes --seed + i)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds; medians (default 3)")
    parser.add_argument("--workers", type=positive_int, default=4, help="emulated workers (default 4)")
    add_emulator_arguments(parser)
    add_run_arguments(
        parser,
        seed_help="seed of workload, emulators and gateways",
        in_flight_help="client connections = concurrency bound",
        warmup=False,
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument(
        "--decision-log",
        action="store_true",
        help="every gateway logs its routing decisions to "
        "<logs>/round<i>/setup<k>/gateway<j>/decisions.jsonl (the workload's request id is the "
        "client request id; use with --logs)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")


def setups(args: argparse.Namespace, modes: list[str]) -> list[Setup]:
    """The baseline first, then K processes per sync mode."""
    k = args.gateways
    out = [Setup(BASELINE, "single", 1, "none")]
    for mode in modes:
        front = "one port, SO_REUSEPORT" if args.front == "reuseport" else "round-robin connections"
        out.append(Setup(f"{k} processes ({front}), sync {mode}", args.front, k, mode))
    return out


async def _replay_through(
    urls: tuple[str, ...], reqs: list[WorkloadRequest], args: argparse.Namespace, processes: int
) -> RouterRun:
    def headers(req: WorkloadRequest) -> dict[str, str]:
        # The request id ties each gateway's decision log to the workload's request stream.
        return {"Authorization": f"Bearer {bench_api_key(req.tenant)}", "x-request-id": req.request_id}

    cfg = ReplayConfig(
        base_url=urls[0],
        model=args.model,
        time_scale=args.time_scale,
        max_in_flight=args.max_in_flight,
        time_limit_s=args.time_limit_s,
        spread_urls=urls,
    )
    # Unmeasured: every gateway's connection pools and first-request set-up, on prompts of their own.
    warm = warmup_requests(reqs[0].tenant, args.workers * processes)
    warm_cfg = ReplayConfig(
        cfg.base_url, cfg.model, max_in_flight=cfg.max_in_flight, time_limit_s=5.0, spread_urls=urls
    )
    await replay(warm, warm_cfg, headers)
    run = RouterRun("replay", "ok")
    run.results = await replay(reqs, cfg, headers)
    return run


def run_setup(
    setup: Setup, reqs: list[WorkloadRequest], args: argparse.Namespace, workdir: Path
) -> tuple[RouterRun, dict[str, int | None]]:
    """One configuration on fresh workers, and its gateways' home-share choices and holds
    (`HERD_EVENTS`; None: not read); everything it started is stopped by PID before it returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = emulator_settings(args)
    started = time.monotonic()
    pool = EmulatorPool(args.workers, settings, workdir / "workers")
    broker: RunningProcess | None = None
    try:
        url = None
        if setup.layout == "rr" and setup.sync != "none":
            broker, url = start_broker(workdir)
        spec = FleetSpec(
            setup.layout,
            setup.processes,
            url,
            args.policy,
            args.model,
            args.seed,
            args.policy_file,
            decision_log=args.decision_log,
            share_calibration=setup.sync == "broker-shared-calibration",
        )
        fleet = start_fleet(spec, pool.urls, sorted({r.tenant for r in reqs}), workdir)
        try:
            run = asyncio.run(_replay_through(fleet.urls, reqs, args, setup.processes))
            herd = {key: metric_sum(fleet.metrics_urls, name) for key, name in HERD_EVENTS.items()}
        finally:
            fleet.stop()
    finally:
        if broker is not None:
            broker.stop()
        pool.stop()
    run.name = setup.name
    run.wall_s = time.monotonic() - started
    return run, {key: None if n is None else int(n) for key, n in herd.items()}


def paired_ratio(rounds: Rounds, base: Rounds, metric: str) -> float | None:
    """The median over rounds of this configuration's value over the baseline's of the same round."""
    ratios = []
    for mine, theirs in zip(rounds.summaries, base.summaries, strict=True):
        a = mine.get(metric) if mine else None
        b = theirs.get(metric) if theirs else None
        if a is not None and b:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def median_of(rounds: Rounds, metric: str) -> float | None:
    values = [s[metric] for s in rounds.summaries if s and s.get(metric) is not None]
    return statistics.median(values) if values else None


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def report(all_rounds: list[Rounds], meta: dict[str, Any]) -> str:
    base = all_rounds[0]
    lines = [
        f"kvgate bench replicas  git {meta['git_sha']}  {meta['source']}, {meta['n_requests']} requests, "
        f"{meta['workers']} workers, policy {meta['policy']}, {meta['repeats']} round(s)",
        "medians over rounds; × 1 = median over rounds of the ratio to the 1-process run of the same round",
        "",
        "| gateways | hit ratio | × 1 | TTFT p50 s | × 1 | TTFT p99 s | × 1 | errors | hit ratio per round"
        " | home choices per round | holds per round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in all_rounds:
        cells = [r.setup.name]
        for metric, spec in zip(METRICS, (".3f", ".3f", ".3f"), strict=True):
            cells.append(_fmt(median_of(r, metric), spec))
            cells.append(_fmt(paired_ratio(r, base, metric), ".3f", "×"))
        cells.append(str(sum(s["n_errors"] for s in r.summaries if s)))
        cells.append(", ".join(_fmt(s.get("hit_ratio") if s else None, ".3f") for s in r.summaries))
        for key in HERD_EVENTS:
            cells.append(", ".join(_fmt(s.get(key) if s else None, "d") for s in r.summaries))
        lines.append("| " + " | ".join(cells) + " |")
    for r in all_rounds:
        lines += [f"{r.setup.name}: failed: {f}" for f in r.failures]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.sync.split(",") if m.strip()]
    if not modes or any(m not in SYNC_MODES for m in modes):
        print(f"kvgate bench replicas: --sync takes {', '.join(SYNC_MODES)}", file=sys.stderr)
        return 2
    if args.front == "reuseport" and "none" in modes:
        print("kvgate bench replicas: --front reuseport always shares: use --sync broker", file=sys.stderr)
        return 2
    try:
        reqs = load_requests(args)
    except (ValueError, TraceFormatError) as exc:
        print(f"kvgate bench replicas: error: {exc}", file=sys.stderr)
        return 2
    meta = {
        **run_metadata(),
        "source": args.trace or f"workload:{args.workload or 'gsp'}",
        "n_requests": len(reqs),
        "workers": args.workers,
        "gateways": args.gateways,
        "front": args.front,
        "policy": str(args.policy_file) if args.policy_file else args.policy,
        "repeats": args.repeats,
        "rate_scale": args.rate_scale,
        "max_in_flight": args.max_in_flight,
        "seed": args.seed,
    }
    all_rounds = [Rounds(s) for s in setups(args, modes)]
    # SIGTERM unwinds like Ctrl-C, so every `finally` stops what it started.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-replicas-") as tmp:
        logs = args.logs or Path(tmp)
        # Rounds interleave the configurations, so a drift of the shared machine hits all of them.
        for i in range(args.repeats):
            for k, rounds in enumerate(all_rounds):
                print(f"round {i + 1}: {rounds.setup.name} ...", file=sys.stderr, flush=True)
                try:
                    done, herd = run_setup(rounds.setup, reqs, args, logs / f"round{i + 1}" / f"setup{k}")
                    rounds.summaries.append({**router_summary(done), **herd})
                except (RuntimeError, TimeoutError, OSError) as exc:
                    rounds.summaries.append(None)
                    rounds.failures.append(f"round {i + 1}: {str(exc)[-300:]}")
    text = report(all_rounds, meta)
    print(text)
    if args.json is not None:
        doc = {
            "config": meta,
            "setups": [
                {
                    "name": r.setup.name,
                    "layout": r.setup.layout,
                    "processes": r.setup.processes,
                    "sync": r.setup.sync,
                    "rounds": r.summaries,
                    "median": {m: median_of(r, m) for m in METRICS},
                    "ratio_to_1": {m: paired_ratio(r, all_rounds[0], m) for m in METRICS},
                    "failures": r.failures,
                }
                for r in all_rounds
            ],
        }
        args.json.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    ok = all(s is not None for r in all_rounds for s in r.summaries)
    return 0 if ok else 1
