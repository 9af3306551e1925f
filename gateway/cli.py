"""The `kvgate` command line.

Each subcommand lives in the package that owns it and is imported only when chosen, so
`kvgate serve` never loads the simulator and the import arrows between packages stay one-way.
A command module provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol


class CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True, slots=True)
class Command:
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "serve": Command("gateway.serve", "run the gateway (--config FILE, or --demo with emulated workers)"),
    "normalize": Command("prompt_normalizer.cli", "print zones and block keys of one request read on stdin"),
    "emulate": Command("loadtest.emulator.cli", "run one emulated vLLM worker"),
    "simulate": Command(
        "loadtest.simulator.cli", "replay a trace or workload through a policy in virtual time"
    ),
}

BENCHMARKS: dict[str, Command] = {
    "overhead": Command("loadtest.bench_overhead", "gateway CPU and latency overhead against peers"),
    "routing": Command("loadtest.bench_routing", "kvgate and peer routers over HTTP on emulated workers"),
    "replay": Command(
        "loadtest.replay.cli", "a bench routing run's decisions against the simulator's, one by one"
    ),
    "keys": Command("prompt_normalizer.bench", "block-key and tokenization time"),
    "drift": Command("loadtest.bench_drift", "hit ratio of a drifting agent workload, rules off and on"),
    "decision": Command("policies.bench", "routing decision latency over many workers"),
    "sync": Command(
        "gateway.sync.bench",
        "replica sync: publish-to-apply latency and CPU over nats-server and redis-server",
    ),
    "replicas": Command(
        "loadtest.bench_replicas", "1 gateway process against K (independent, synced) on emulated workers"
    ),
    "abuse": Command("loadtest.abuse.cli", "reliability probes: hostile clients, failing workers; a soak"),
    "fairness": Command(
        "loadtest.bench_fairness", "a light tenant's wait while another floods a full pool (the queue)"
    ),
    "goodput": Command("loadtest.goodput.cli", "each policy's highest rate meeting TTFT and TPOT SLOs"),
    "pd": Command(
        "loadtest.bench_pd", "kvgate and smg --pd-disaggregation over HTTP on P/D emulated workers"
    ),
}


def package_version() -> str:
    """The installed distribution's version (what the image and the chart's appVersion carry)."""
    try:
        return version("kvgate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware LLM gateway")
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvgate {package_version()}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen: dict[str, Command] = {}
    argv = sys.argv[1:]
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if argv[:1] == [name]:
            _load(cmd).add_arguments(p)
            chosen[name] = cmd
    bench = sub.add_parser("bench", help="benchmarks (not tests): print ratios against baselines")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, cmd in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=cmd.help, description=cmd.help)
        if argv[:2] == ["bench", name]:
            _load(cmd).add_arguments(p)
            chosen[f"bench {name}"] = cmd
    return parser, chosen


def _load(cmd: Command) -> CommandModule:
    module: CommandModule = importlib.import_module(cmd.module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser, chosen = _build_parser()
    args = parser.parse_args()
    key = f"bench {args.bench}" if args.command == "bench" else args.command
    return _load(chosen[key]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
