"""`kvgate bench replay`: an HTTP routing run's decisions against the simulator's, one by one.

    kvgate bench replay --run DIR [--router kvgate:cost] [--arrivals http|workload] [--free]

DIR is a `kvgate bench routing --decision-log` output directory. The request stream is rebuilt
from its `results.json` (workload or trace, its options, seed, request count), the decisions come
from `logs/<router>/decisions.jsonl`. The simulator runs the same stream, on as many workers with
the same cache size, under the policy file the gateway ran (`logs/<router>/policy.yaml`), with each
request placed where the HTTP run placed it (`forced.py`); the report is the agreement of the
two, by the HTTP run's reason, and the first divergences with the signals that differ. `--free`
also runs the simulator on its own choices and prints its hit ratio next to the HTTP run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import orjson

from loadtest.bench_routing import (
    DECISIONS_FILE,
    DEFAULT_KV_BLOCKS,
    WARMUP_PREFIX,
    load_requests,
    warmup_request,
)
from loadtest.cli_args import positive_float, positive_int
from loadtest.engine import DEFAULT_PROFILE, Engine, EngineConfig, EngineRequest, load_profile
from loadtest.engine.hashing import block_hashes
from loadtest.replay.compare import compare, reason_agreement, render
from loadtest.replay.forced import ForcedPolicy
from loadtest.replay.log import HttpDecision, read_decisions, rebase
from loadtest.simulator.keys import KeyPath
from loadtest.simulator.loop import EngineHooks, LoopConfig, LoopResult, run_loop
from loadtest.workloads.records import WorkloadRequest
from policies.base import RoutingPolicy
from policies.config import PolicyConfig, build_policy, parse_policy_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, help="a `kvgate bench routing --decision-log` output directory"
    )
    parser.add_argument(
        "--router", default="kvgate:cost", help="the kvgate router of that run (default cost)"
    )
    parser.add_argument(
        "--arrivals",
        choices=["http", "workload"],
        default="http",
        help="arrival times: when the gateway routed each request (default) or the workload's",
    )
    parser.add_argument(
        "--scrape-interval-s",
        type=positive_float,
        default=1.0,
        help="simulated /metrics period (gateway: 1 s)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="leave the run's warm-up requests out of the simulation (they are replayed by default)",
    )
    parser.add_argument("--free", action="store_true", help="also simulate without forcing placements")
    parser.add_argument("--keep", type=positive_int, default=20, help="divergences to print")
    parser.add_argument("--json", metavar="OUT", help="write the comparison here")


def _stream(
    config: dict[str, Any], http: dict[str, HttpDecision], warm: dict[str, HttpDecision], arrivals: str
) -> list[WorkloadRequest]:
    """The run's measured requests (those in `http`) after its warm-up requests (those in `warm`),
    at the times the gateway routed them, or the measured ones at the workload's times."""
    ns = argparse.Namespace(
        trace=config.get("trace"),
        users=config.get("users") or 1,
        seed=config["seed"],
        workload=config.get("workload"),
        workload_arg=config.get("workload_args") or [],
        max_requests=config.get("max_requests") or config["n_requests"],
        rate_scale=config.get("rate_scale") or 1.0,
    )
    stream = load_requests(ns)
    reqs = [r for r in stream if r.request_id in http]
    t0 = rebase([*http.values(), *warm.values()])
    if arrivals == "http":
        reqs = [dataclasses.replace(r, arrival_s=http[r.request_id].t_s - t0) for r in reqs]
    elif reqs:
        first = rebase(http.values()) - t0 - reqs[0].arrival_s
        reqs = [dataclasses.replace(r, arrival_s=r.arrival_s + first) for r in reqs]
    # The warm-up went through the same policy first: it moved the calibration and the load
    # history every later decision was scored with.
    warmups = [
        dataclasses.replace(
            warmup_request(int(rid.removeprefix(WARMUP_PREFIX)), stream[0].tenant), arrival_s=d.t_s - t0
        )
        for rid, d in warm.items()
    ]
    return sorted([*warmups, *reqs], key=lambda r: r.arrival_s)


def _policy(workdir: Path) -> RoutingPolicy:
    path = workdir / "policy.yaml"
    config = parse_policy_yaml(path.read_text(), workdir) if path.exists() else PolicyConfig()
    return build_policy(config)


def simulate(
    reqs: list[WorkloadRequest],
    config: dict[str, Any],
    policy: RoutingPolicy,
    scrape_interval_s: float,
) -> LoopResult:
    """The stream on the run's worker count and cache size, engines as the emulated workers run."""
    profile = load_profile(config.get("profile") or DEFAULT_PROFILE)
    engine_config = EngineConfig(kv_blocks=config.get("kv_blocks") or DEFAULT_KV_BLOCKS, seed=config["seed"])
    engines = [Engine(profile, engine_config) for _ in range(config["workers"])]
    seed = config["seed"]

    def make_request(request_id: str, n_prompt: int, max_out: int, hashes: Any) -> EngineRequest:
        return EngineRequest(request_id, n_prompt, max_out, hashes)

    def hash_tokens(tokens: Any, size: int, salt: str | None) -> list[int]:
        return block_hashes(tokens, size, salt, seed)

    keys = KeyPath(model=config.get("model") or "emulated-llama")
    hooks = EngineHooks(make_request, hash_tokens, keys)
    return run_loop(reqs, engines, policy, hooks, LoopConfig(scrape_interval_s=scrape_interval_s))


def hit_ratio(result: LoopResult) -> float:
    """Over the measured requests (the warm-up left out, as the HTTP run leaves it out)."""
    measured = [r for r in result.requests if not r.request_id.startswith(WARMUP_PREFIX)]
    prompt = sum(r.prompt_tokens for r in measured)
    return sum(r.cached_tokens for r in measured) / prompt if prompt else 0.0


def http_hit_ratio(http: dict[str, HttpDecision]) -> float:
    prompt = sum(d.prompt_tokens or 0 for d in http.values())
    return sum(d.cached_tokens or 0 for d in http.values()) / prompt if prompt else 0.0


def run(args: argparse.Namespace) -> int:
    out = Path(args.run)
    workdir = out / "logs" / args.router.replace(":", "_")
    log_path = workdir / DECISIONS_FILE
    try:
        config = orjson.loads((out / "results.json").read_bytes())["config"]
        logged, workers = read_decisions(log_path, skip_prefix=None)
    except (OSError, KeyError, ValueError) as exc:
        print(f"kvgate bench replay: error: {exc}", file=sys.stderr)
        return 2
    if len(workers) != config["workers"]:
        print(
            f"kvgate bench replay: the log names {len(workers)} workers, the run had {config['workers']}",
            file=sys.stderr,
        )
        return 2
    http = {rid: d for rid, d in logged.items() if not rid.startswith(WARMUP_PREFIX)}
    warm = {} if args.no_warmup else {rid: d for rid, d in logged.items() if rid.startswith(WARMUP_PREFIX)}
    reqs = _stream(config, http, warm, args.arrivals)
    forced = ForcedPolicy(_policy(workdir), {rid: d.worker for rid, d in logged.items()})
    result = simulate(reqs, config, forced, args.scrape_interval_s)
    agreement = compare(http, forced.decisions, args.keep)
    print(f"router {args.router}, {len(http)} requests after {len(warm)} warm-up, arrivals: {args.arrivals}")
    print(
        f"hit ratio: HTTP {http_hit_ratio(http):.3f}, simulator with HTTP placements {hit_ratio(result):.3f}"
    )
    doc: dict[str, Any] = {"agreement": agreement.ratio, "n": agreement.n, "same": agreement.same}
    if args.free:
        free = ForcedPolicy(_policy(workdir), None)
        free_result = simulate(reqs, config, free, args.scrape_interval_s)
        free_agreement = compare(http, free.decisions, 0)
        same_reason = reason_agreement(http, free.decisions)
        print(
            f"simulator on its own choices: hit ratio {hit_ratio(free_result):.3f}, same worker "
            f"{free_agreement.ratio:.1%} (histories diverge), same reason {same_reason:.1%}"
        )
        doc["free"] = {
            "hit_ratio": hit_ratio(free_result),
            "agreement": free_agreement.ratio,
            "same_reason": same_reason,
        }
    print(render(agreement))
    if args.json:
        doc["divergences"] = [
            {"request_id": d.request_id, "signals": d.signals, "detail": d.detail}
            for d in agreement.divergences
        ]
        Path(args.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 0
