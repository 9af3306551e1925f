"""`kvgate bench fairness`: does a tenant that floods a full pool delay a light tenant?

Real processes on loopback: `--workers` emulated vLLM workers, and kvgate in front of them with
`max_in_flight_per_worker` small, so the pool is full and requests wait in the gateway's queue.
Two tenants send streamed chats in closed loops: `light` with `--light-clients` clients, `heavy`
with `--ratio` times as many. Phases, each `--duration-s` long:

1. alone: light only (the pool has room, nothing queues): its unloaded wait for an answer;
2. flood: heavy and light together, the queue in fair order (weighted fair across tenants);
3. flood again with `queue.order: fifo` (arrival order whatever the tenant), for comparison.

It prints each tenant's requests, non-200 answers, p50 / p99 latency (time to the whole answer),
p99 time to first token, p99 queue wait (the gateway's `queue_ms`), and the ratios of the light
tenant's p99 latency under the flood to its unloaded p99. Requests started in the first
`--warmup-s` of a phase are not counted. Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml

from loadtest.cli_args import positive_float, positive_int
from loadtest.fairness_load import Sample, Tenant, percentile, queue_waits_ms, run_phase
from loadtest.peers.emulators import EmulatorPool, EmulatorSettings
from loadtest.peers.kvgate import BENCH_SECRET, bench_api_key
from loadtest.peers.launch import RunningProcess, wait_http_ready
from loadtest.ports import free_port
from loadtest.report.meta import run_metadata
from policies.identity import hash_api_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive_int, default=2, help="emulated workers (default 2)")
    parser.add_argument(
        "--max-in-flight", type=positive_int, default=4, help="max_in_flight_per_worker (default 4)"
    )
    parser.add_argument("--light-clients", type=positive_int, default=2, help="light tenant's clients")
    parser.add_argument("--ratio", type=positive_int, default=10, help="heavy clients per light client")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per answer")
    parser.add_argument(
        "--prompt-chars",
        type=positive_int,
        default=400,
        help="prompt length in characters (the emulator counts one token per byte; default 400)",
    )
    parser.add_argument("--duration-s", type=positive_float, default=20.0, help="length of each phase")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="start of each phase not counted")
    parser.add_argument("--queue-timeout-s", type=positive_float, default=60.0, help="queue.timeout_s")
    parser.add_argument("--orders", default="fair,fifo", help="queue orders of the flood phases")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, help="emulator time scale")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and emulators")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    parser.add_argument("--workdir", default=None, help="keep configs and logs here (default: temporary)")


def _gateway_config(args: argparse.Namespace, urls: Sequence[str], order: str, port: int) -> dict[str, Any]:
    secret = BENCH_SECRET.encode()
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "metrics": {"listen": {"host": "127.0.0.1", "port": 0}},
        "log_level": "info",  # the access lines carry each request's queue_ms
        "pools": [
            {
                "name": "bench",
                "models": ["emulated-llama"],
                "workers": list(urls),
                "max_in_flight_per_worker": args.max_in_flight,
                "queue": {"timeout_s": args.queue_timeout_s, "order": order},
                "health": {"interval_s": 1.0, "timeout_s": 1.0},
            }
        ],
        "tenants": [
            {"name": name, "api_key_hashes": [hash_api_key(secret, bench_api_key(name))]}
            for name in ("heavy", "light")
        ],
    }


def _start_gateway(
    args: argparse.Namespace, urls: Sequence[str], order: str, workdir: Path
) -> tuple[RunningProcess, str]:
    port = free_port()
    folder = workdir / order
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "gateway.yaml"
    config.write_text(yaml.safe_dump(_gateway_config(args, urls, order, port), sort_keys=False))
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    proc = RunningProcess(argv, env={"KVGATE_KEY_SECRET": BENCH_SECRET}, log_path=folder / "gateway.log")
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(base_url + "/readyz", proc, 30.0)
    except BaseException:
        proc.stop()
        raise
    return proc, base_url


def _row(phase: str, tenant: str, samples: list[Sample], waits: dict[str, float]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200]
    return {
        "phase": phase,
        "tenant": tenant,
        "requests": len(samples),
        "non_200": {
            str(status): sum(1 for s in samples if s.status == status)
            for status in sorted({s.status for s in samples if s.status != 200})
        },
        "p50_latency_s": percentile((s.latency_s for s in ok), 50),
        "p99_latency_s": percentile((s.latency_s for s in ok), 99),
        "p99_ttft_s": percentile((s.ttft_s for s in ok if s.ttft_s is not None), 99),
        "p50_queue_ms": percentile((waits.get(s.request_id, 0.0) for s in ok), 50),
        "p99_queue_ms": percentile((waits.get(s.request_id, 0.0) for s in ok), 99),
        "mean_queue_ms": statistics.fmean([waits.get(s.request_id, 0.0) for s in ok]) if ok else float("nan"),
    }


async def _phase(args: argparse.Namespace, base_url: str, phase: str, flood: bool) -> list[Sample]:
    light = Tenant("light", bench_api_key("light"), args.light_clients)
    tenants = (
        [light, Tenant("heavy", bench_api_key("heavy"), args.light_clients * args.ratio)]
        if flood
        else [light]
    )
    samples = await run_phase(
        base_url,
        "emulated-llama",
        tenants,
        phase=phase,
        duration_s=args.duration_s,
        max_tokens=args.max_tokens,
        prompt_chars=args.prompt_chars,
        seed=args.seed,
    )
    return [s for s in samples if s.started_s >= args.warmup_s]


def _measure(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    settings = EmulatorSettings(time_scale=args.time_scale, seed=args.seed)
    workers = EmulatorPool(args.workers, settings, workdir / "workers")
    rows: list[dict[str, Any]] = []
    try:
        for n, order in enumerate(orders):
            gateway, base_url = _start_gateway(args, workers.urls, order, workdir)
            try:
                phases = [("alone", False)] if n == 0 else []
                phases.append((f"flood {args.ratio}:1 ({order})", True))
                collected = [
                    (name, asyncio.run(_phase(args, base_url, name.split()[0] + order, flood)))
                    for name, flood in phases
                ]
            finally:
                gateway.stop()
            waits = queue_waits_ms(gateway.log_path)
            for name, samples in collected:
                for tenant in ("light", "heavy"):
                    mine = [s for s in samples if s.tenant == tenant]
                    if mine:
                        rows.append(_row(name, tenant, mine, waits))
    finally:
        workers.stop()
    return rows


_COLUMNS = (
    "phase",
    "tenant",
    "requests",
    "non-200",
    "p50 latency s",
    "p99 latency s",
    "p99 TTFT s",
    "p50 / p99 queue ms",
)


def _print(rows: list[dict[str, Any]]) -> dict[str, float]:
    print("| " + " | ".join(_COLUMNS) + " |")
    print("|---" * len(_COLUMNS) + "|")
    for r in rows:
        non_200 = ", ".join(f"{k}: {v}" for k, v in r["non_200"].items()) or "0"
        cells = (
            r["phase"],
            r["tenant"],
            str(r["requests"]),
            non_200,
            f"{r['p50_latency_s']:.3f}",
            f"{r['p99_latency_s']:.3f}",
            f"{r['p99_ttft_s']:.3f}",
            f"{r['p50_queue_ms']:.1f} / {r['p99_queue_ms']:.1f}",
        )
        print("| " + " | ".join(cells) + " |")
    alone = next((r for r in rows if r["phase"] == "alone"), None)
    ratios: dict[str, float] = {}
    if alone is None:
        return ratios
    for r in rows:
        if r["tenant"] == "light" and r["phase"] != "alone":
            ratio = r["p99_latency_s"] / alone["p99_latency_s"]
            ratios[r["phase"]] = ratio
            print(f"light p99 latency, {r['phase']} / alone: {ratio:.2f}x (goal <= 2x)")
    return ratios


def run(args: argparse.Namespace) -> int:
    meta = run_metadata()
    heavy = args.light_clients * args.ratio
    print(
        f"kvgate bench fairness: git {meta['git_sha']}, {args.workers} workers x {args.max_in_flight}"
        f" slots, light {args.light_clients} clients, heavy {heavy}, {args.duration_s:g} s per phase"
    )
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = _measure(args, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvgate-fairness-") as tmp:
            rows = _measure(args, Path(tmp))
    ratios = _print(rows)
    if args.json:
        report = {"meta": meta, "args": vars(args), "rows": rows, "ratios": ratios}
        Path(args.json).write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench fairness", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
