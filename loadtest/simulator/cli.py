"""`kvgate simulate`: replay a trace or a workload through a routing policy in virtual time.

    kvgate simulate --trace FILE|NAME | --workload NAME [--policy NAME] [--policy-config FILE]
        [--workers N] [--kv-blocks-per-worker N] [--profile NAME] [--rate-scale X] [--closed-loop] [--seed S]
        [--isolation LEVEL] [--tenant-isolation NAME=LEVEL] [--kv-events] [--json OUT]
        [--gateways N [--sync none|broker] [--sync-delay-ms D]] [--arrival-spread-s S]
        [--pd P:D [--no-pd-conditional] [--pd-interference-weight W]]

Prints the summary; `--json` writes `{config, summary, workers, requests}` (format in
docs/benchmarks.md, "Simulator output format").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import xxhash

from loadtest.cli_args import UsageError, positive_int, worker_split
from loadtest.engine import DEFAULT_PROFILE, Engine, EngineConfig, EngineRequest, ProfileError, load_profile
from loadtest.engine.hashing import block_hashes
from loadtest.engine.profile import StepProfile
from loadtest.report.meta import run_metadata
from loadtest.report.progress import ProgressBar
from loadtest.simulator.keys import KeyPath
from loadtest.simulator.loop import EngineHooks, LoopConfig, run_loop
from loadtest.simulator.pd import PdSim
from loadtest.simulator.summary import summarize
from loadtest.traces.load import load_trace
from loadtest.traces.mooncake import TraceFormatError
from loadtest.workloads.ceilings import ceiling_infinite, ceiling_pooled_lru, working_set_tokens
from loadtest.workloads.records import WorkloadRequest, scale_arrivals
from loadtest.workloads.registry import WORKLOADS, make_workload
from policies.base import Isolation, RoutingPolicy
from policies.config import PolicyConfig, PolicyConfigError, build_policy, parse_policy_yaml
from policies.pd import HOLDER_PREFILL, PAIRS, VLLM_ROLES, PdRouter, PdSettings
from policies.registry import known_policies, make_policy

# The gateway's measured NATS publish-to-apply latency, batching included (docs/sync.md).
DEFAULT_SYNC_DELAY_MS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        metavar="FILE|NAME",
        help="Mooncake .jsonl or kv-cache-tester .json trace (plain, .gz or .xz), or a shipped trace: "
        "mooncake-conversation, mooncake-synthetic, kvct-agent",
    )
    src.add_argument("--workload", metavar="NAME", help=f"synthetic workload: {', '.join(sorted(WORKLOADS))}")
    parser.add_argument("--workload-arg", action="append", default=[], metavar="K=V", help="workload option")
    parser.add_argument(
        "--users", type=positive_int, default=1, help="replay the trace as this many salted users"
    )
    parser.add_argument("--user-spread-s", type=float, default=0.0, help="users start within this window")
    parser.add_argument(
        "--tenant-per-user", action="store_true", help="each replayed user is its own tenant trace-u<i>"
    )
    parser.add_argument(
        "--policy", default=None, help="registered policy name (default: the policy file default, cost)"
    )
    parser.add_argument("--policy-config", metavar="FILE", help="policy YAML (policy, seed, options)")
    parser.add_argument("--workers", type=int, default=8, help="simulated workers (default 8)")
    parser.add_argument(
        "--kv-blocks-per-worker", type=positive_int, default=None, help="default: the profile's"
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="engine step-time profile")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate by X")
    parser.add_argument(
        "--closed-loop",
        action="store_true",
        help="an agent trace's turns wait for the answers they follow, then their think time (divided "
        "by --rate-scale), as its client would; default: each is sent when the recording sent it",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and policy (default 0)")
    parser.add_argument("--json", metavar="OUT", help="write per-request records and the summary here")
    parser.add_argument("--kv-events", action="store_true", help="feed the engines' KV events to the policy")
    levels = [i.value for i in Isolation]
    parser.add_argument("--isolation", choices=levels, default="strict", help="every tenant's isolation")
    parser.add_argument(
        "--tenant-isolation", action="append", default=[], metavar="NAME=LEVEL", help="one tenant's isolation"
    )
    parser.add_argument("--scrape-interval-s", type=float, default=1.0, help="how stale scraped metrics are")
    parser.add_argument("--max-requests", type=positive_int, default=None, help="only the first N requests")
    parser.add_argument(
        "--pd",
        metavar="P:D",
        default=None,
        help="prefill/decode disaggregation: P prefill and D decode workers (instead of --workers mixed "
        "ones), pairs chosen as the gateway does (docs/pd.md); 'holder_prefill': the --workers stay "
        "mixed and a request is split only to prefill on the holder of its prompt (pd.mode)",
    )
    parser.add_argument(
        "--pd-conditional",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--pd: let a request run on one decode worker alone when that scores better (default on)",
    )
    parser.add_argument(
        "--pd-interference-weight",
        type=float,
        default=1.0,
        help="--pd: weight of the delay a prefill on a decode worker adds to its decodes (default 1)",
    )
    parser.add_argument(
        "--pd-holder-share",
        type=float,
        default=0.5,
        help="--pd holder_prefill: the share of the prompt a worker must hold to prefill a request "
        "the policy sent elsewhere (pd.holder_share, default 0.5)",
    )
    parser.add_argument(
        "--arrival-spread-s",
        type=float,
        default=0.0,
        help="move each arrival later by a seeded uniform draw in [0, S) s (for traces whose "
        "timestamps are coarse: same-stamp requests otherwise arrive at one instant)",
    )
    parser.add_argument(
        "--gateways",
        type=positive_int,
        default=1,
        help="gateway instances behind an L4 balancer (default 1)",
    )
    parser.add_argument(
        "--sync",
        choices=["none", "broker"],
        default="none",
        help="broker: each gateway applies what the others publish (default none: each learns alone)",
    )
    parser.add_argument(
        "--sync-delay-ms",
        type=float,
        default=DEFAULT_SYNC_DELAY_MS,
        help=f"broker: publish-to-apply delay in ms (default {DEFAULT_SYNC_DELAY_MS:g}, see docs/sync.md)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _requests(args: argparse.Namespace) -> tuple[list[WorkloadRequest], str]:
    if args.trace:
        t = load_trace(
            args.trace,
            users=args.users,
            user_spread_s=args.user_spread_s,
            seed=args.seed,
            tenant_per_user=args.tenant_per_user,
        )
        reqs, source = list(t.requests), f"trace:{args.trace}"
    else:
        try:
            reqs = make_workload(args.workload, args.seed, args.workload_arg)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        source = f"workload:{args.workload}"
    if args.max_requests is not None:
        reqs = reqs[: args.max_requests]
    if args.rate_scale != 1.0:
        reqs = scale_arrivals(reqs, args.rate_scale)
    if args.arrival_spread_s > 0:
        reqs = spread_arrivals(reqs, args.arrival_spread_s, args.seed)
    if not reqs:
        raise UsageError("no requests to simulate")
    return reqs, source


def spread_arrivals(reqs: list[WorkloadRequest], spread_s: float, seed: int) -> list[WorkloadRequest]:
    """Each arrival moved later by `spread_s` × a uniform draw seeded by the request id alone."""
    out = [
        dataclasses.replace(
            r, arrival_s=r.arrival_s + spread_s * xxhash.xxh64_intdigest(r.request_id.encode(), seed) / 2**64
        )
        for r in reqs
    ]
    return sorted(out, key=lambda r: r.arrival_s)


def _policy(args: argparse.Namespace, gateway: int = 0) -> tuple[RoutingPolicy, str]:
    """Gateway `gateway`'s policy: gateway 0 takes the seed as given, the others their own seeds
    (independent tie-breaks, as separate processes would have)."""
    seed = args.seed + 7919 * gateway
    if args.policy_config:
        try:
            text = Path(args.policy_config).read_text()
        except OSError as exc:
            raise UsageError(f"--policy-config: {exc}") from None
        config = parse_policy_yaml(text, Path(args.policy_config).parent)
        if args.policy and args.policy != config.policy:
            raise UsageError(
                f"--policy {args.policy} contradicts {args.policy_config} (policy: {config.policy})"
            )
        return build_policy(config.model_copy(update={"seed": config.seed + 7919 * gateway})), config.policy
    name = args.policy or PolicyConfig().policy
    try:
        return make_policy(name, seed=seed), name
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def key_path(args: argparse.Namespace) -> KeyPath:
    """The gateway's key path with the isolation levels the command line asks for."""
    per_tenant: dict[str, Isolation] = {}
    for item in args.tenant_isolation:
        name, sep, level = item.partition("=")
        if not sep or not name or level not in {i.value for i in Isolation}:
            raise UsageError(f"--tenant-isolation {item!r}: expected NAME=strict|shared_public|public")
        per_tenant[name] = Isolation(level)
    return KeyPath(isolation=Isolation(args.isolation), tenant_isolation=per_tenant)


def _install_precise(policy: RoutingPolicy, keys: KeyPath, block_size: int) -> bool:
    """Precise mode as the gateway installs it: KV events keyed by the normalizer's token hasher
    under the deployment's identity (its base model) and the engine's block size."""
    setter = getattr(policy, "set_token_hasher", None)
    if setter is None:
        return False
    identity = dataclasses.replace(keys.base, block_size_tokens=block_size)
    setter(keys.normalizer.token_hasher(identity))
    return True


def pd_split(text: str | None) -> tuple[int, int] | None:
    """`--pd P:D` as two worker counts (None without `--pd`, or with `holder_prefill`)."""
    return None if text is None or text == HOLDER_PREFILL else worker_split(text)


def vllm_pd_sim(
    spec: str | None,
    profile: StepProfile,
    seed: int,
    conditional: bool,
    interference_weight: float = 1.0,
    holder_share: float = 0.5,
) -> PdSim | None:
    """The P/D side of the loop for `--pd SPEC` (also a goodput row's `pd`): None without one;
    for P:D the gateway's pair chooser over vLLM roles, the first P workers prefilling; for
    `holder_prefill` every worker mixed and the chooser in that mode. The transfer is priced
    from the engine profile."""
    if spec is None:
        return None
    holder = spec == HOLDER_PREFILL
    settings = PdSettings(
        roles=VLLM_ROLES,
        transfer_setup_s=profile.kv_transfer_setup_ms / 1000,
        transfer_bytes_per_token=profile.kv_bytes_per_token,
        transfer_bandwidth_bytes_per_s=profile.kv_transfer_bytes_per_s,
        conditional=conditional,
        interference_weight=interference_weight,
        holder_share=holder_share,
        mode=HOLDER_PREFILL if holder else PAIRS,
    )
    n_prefill = 0 if holder else worker_split(spec)[0]

    def make_request(rid: str, n_prompt: int, max_out: int, hashes: Any, external: int) -> EngineRequest:
        return EngineRequest(rid, n_prompt, max_out, hashes, external)

    return PdSim(PdRouter(settings, seed=seed), n_prefill, profile.kv_transfer_s, make_request)


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation; returns the JSON document."""
    split = pd_split(args.pd)
    if split is not None:
        args.workers = sum(split)
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.rate_scale <= 0:
        raise UsageError("--rate-scale must be positive")
    if args.sync_delay_ms < 0 or args.arrival_spread_s < 0:
        raise UsageError("--sync-delay-ms and --arrival-spread-s must be >= 0")
    if not 0 <= args.pd_holder_share < 1:
        raise UsageError("--pd-holder-share must be in [0, 1)")
    profile = load_profile(args.profile)
    pd = vllm_pd_sim(
        args.pd, profile, args.seed, args.pd_conditional, args.pd_interference_weight, args.pd_holder_share
    )
    policy, policy_name = _policy(args)
    policies = [policy] + [_policy(args, g)[0] for g in range(1, args.gateways)]
    reqs, source = _requests(args)
    engine_config = EngineConfig(kv_blocks=args.kv_blocks_per_worker, seed=args.seed)
    engines = [Engine(profile, engine_config) for _ in range(args.workers)]
    block_size, kv_blocks = engines[0].block_size, engines[0].num_blocks

    keys = key_path(args)
    keyed = [keys.keyed(r) for r in reqs]
    chains = [k.chain() for k in keyed]
    precise = args.kv_events and all([_install_precise(p, keys, block_size) for p in policies])
    capacity_tokens = args.workers * kv_blocks * block_size
    working_set = working_set_tokens(chains)
    inf = ceiling_infinite(chains)
    lru = ceiling_pooled_lru(chains, capacity_tokens)

    def make_request(request_id: str, n_prompt: int, max_out: int, hashes: Any) -> EngineRequest:
        return EngineRequest(request_id, n_prompt, max_out, hashes)

    def hash_tokens(tokens: Any, size: int, salt: str | None) -> list[int]:
        return block_hashes(tokens, size, salt, args.seed)

    bar = None if args.quiet else ProgressBar(len(reqs), f"simulate {policy_name}")
    started = time.monotonic()
    result = run_loop(
        reqs,
        engines,
        policies,
        EngineHooks(make_request, hash_tokens, keys),
        LoopConfig(
            scrape_interval_s=args.scrape_interval_s,
            kv_events=args.kv_events,
            sync_delay_s=args.sync_delay_ms / 1000 if args.sync == "broker" else None,
            balancer_seed=args.seed,
            pd=pd,
            closed_loop=args.closed_loop,
        ),
        progress=bar.update if bar else None,
        keyed=keyed,
    )
    wall_s = time.monotonic() - started
    if bar:
        bar.close()
    summary = summarize(
        result.requests, result.workers, ceiling_infinite=inf.hit_ratio, ceiling_pooled_lru=lru.hit_ratio
    )
    counters: dict[str, int] = {}
    for p in policies:  # summed over the gateways
        stats = getattr(p, "stats", None)
        for name, value in (stats().counters if callable(stats) else {}).items():
            counters[name] = counters.get(name, 0) + value
    summary.update(
        {
            "policy_counters": counters,
            "wall_time_s": wall_s,
            "n_engine_steps": result.n_steps,
            "working_set_tokens": working_set,
            "cluster_kv_tokens": capacity_tokens,
            "cluster_kv_fraction_of_working_set": capacity_tokens / working_set if working_set else None,
            "pd": pd.counters.as_dict() if pd is not None else None,
            "sync_items_published": result.n_sync_items,
        }
    )
    config = {
        **run_metadata(),
        "source": source,
        "n_requests": len(reqs),
        "users": args.users,
        "tenant_per_user": args.tenant_per_user,
        "policy": policy_name,
        "policy_config": args.policy_config,
        "workers": args.workers,
        "kv_blocks_per_worker": kv_blocks,
        "block_size_tokens": block_size,
        "profile": profile.name,
        "rate_scale": args.rate_scale,
        "closed_loop": args.closed_loop,
        "arrival_spread_s": args.arrival_spread_s,
        "seed": args.seed,
        "kv_events": args.kv_events,
        "precise": precise,
        "isolation": args.isolation,
        "tenant_isolation": list(args.tenant_isolation),
        "scrape_interval_s": args.scrape_interval_s,
        "pd": args.pd,
        "pd_conditional": args.pd_conditional if split is not None else None,
        "pd_interference_weight": args.pd_interference_weight if split is not None else None,
        "pd_holder_share": args.pd_holder_share if args.pd == HOLDER_PREFILL else None,
        "gateways": args.gateways,
        "sync": args.sync,
        "sync_delay_ms": args.sync_delay_ms if args.sync == "broker" else None,
    }
    return {
        "config": config,
        "summary": summary,
        "workers": list(result.workers),
        "requests": list(result.requests),
    }


SUMMARY_KEYS = (
    "n_requests", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s", "tpot_mean_s", "tpot_p99_s",
    "e2e_p99_s", "throughput_tok_s", "hit_ratio", "ceiling_infinite", "ceiling_pooled_lru",
    "hit_ratio_of_ceiling", "request_hit_ratio", "imbalance", "utilization", "n_rejected", "wall_time_s",
)  # fmt: skip


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run(args: argparse.Namespace) -> int:
    try:
        doc = simulate(args)
    except (UsageError, TraceFormatError, ProfileError, PolicyConfigError) as exc:
        print(f"kvgate simulate: error: {exc}", file=sys.stderr)
        if "unknown policy" in str(exc):
            print(f"known policies: {', '.join(known_policies())}", file=sys.stderr)
        return 2
    s = doc["summary"]
    for key in SUMMARY_KEYS:
        print(f"{key:24s} {_fmt(s[key])}")
    for part in ("cold_start", "steady_state"):
        p = s[part]
        print(f"{part:24s} hit_ratio {_fmt(p['hit_ratio'])}  ttft_p50_s {_fmt(p['ttft_p50_s'])}  "
              f"ttft_p99_s {_fmt(p['ttft_p99_s'])}")  # fmt: skip
    if s.get("pd"):
        print(f"{'pd':24s} " + "  ".join(f"{k} {v}" for k, v in s["pd"].items()))
    counters = s["policy_counters"]
    if counters:
        print(f"{'policy_counters':24s} " + "  ".join(f"{k} {v}" for k, v in sorted(counters.items())))
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY))
        print(f"wrote {args.json}")
    return 0
