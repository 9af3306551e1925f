"""`kvgate bench abuse`: run the reliability probes (and optionally a soak) against a fresh stack.

    kvgate bench abuse                         # every probe, full sizes
    kvgate bench abuse --quick --only deep_json,trailing_slash
    kvgate bench abuse --soak-minutes 10 [--load-fraction 0.8]
    kvgate bench abuse --only soak --soak-minutes 30

Prints `probe | expected | observed | ok` (and the soak's figures); `--json` prints one JSON
document instead. The exit status is 1 when a probe failed or the soak saw an error, 2 when the
stack could not start, 143 on SIGTERM (the stack is stopped first, as on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from loadtest.abuse import probe_drain, probes_clients, probes_connections, probes_fleet, probes_outcomes
from loadtest.abuse.client import new_session
from loadtest.abuse.observe import AccessLog
from loadtest.abuse.probe import Context, Probe, run_probe
from loadtest.abuse.report import Verdict, table
from loadtest.abuse.settings import FULL, QUICK, Sizes
from loadtest.abuse.soak import SoakReport, soak, soak_text
from loadtest.abuse.stack import Stack, start_stack
from loadtest.report.meta import run_metadata

PROBES: tuple[Probe, ...] = (
    probes_clients.PROBES
    + probes_connections.PROBES
    + probes_outcomes.PROBES
    + probes_fleet.PROBES
    + probe_drain.PROBES
)
SOAK = "soak"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(p.name for p in PROBES)
    parser.add_argument(
        "--only", default=None, metavar="NAME[,NAME]", help=f"run only these probes ({names}; or {SOAK})"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and shorter client deadlines")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument(
        "--soak-minutes",
        type=float,
        default=0.0,
        help="after the probes, soak for this long (default 0: no soak)",
    )
    parser.add_argument(
        "--load-fraction", type=float, default=0.8, help="soak rate as a share of measured capacity (0.8)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the soak's arrivals (default 0)")
    parser.add_argument("--workdir", default=None, help="keep configs and process logs here")


def _select(only: str | None) -> tuple[list[Probe], bool]:
    """The probes to run, in suite order, and whether only the soak was asked for."""
    if only is None:
        return list(PROBES), False
    wanted = {name.strip() for name in only.split(",") if name.strip()}
    known = {p.name for p in PROBES} | {SOAK}
    unknown = wanted - known
    if unknown:
        raise ValueError(f"unknown probe {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    return [p for p in PROBES if p.name in wanted], wanted == {SOAK}


async def _run(
    stack: Stack, sizes: Sizes, probes: list[Probe], args: argparse.Namespace, progress: bool
) -> tuple[list[Verdict], SoakReport | None]:
    verdicts: list[Verdict] = []
    report = None
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, _interrupt, task)
    async with new_session() as session:
        ctx = Context(stack, sizes, session, AccessLog(stack.gateway_log), f"ab{os.getpid()}")
        last = [p for p in probes if p.name == "drain"]  # it stops the gateway
        for probe in [p for p in probes if p.name != "drain"]:
            verdicts.append(await run_probe(probe, ctx))
            if progress:
                _progress(verdicts[-1])
        if args.soak_minutes > 0:
            report = await soak(ctx, args.soak_minutes, args.load_fraction, args.seed)
        for probe in last:
            verdicts.append(await run_probe(probe, ctx))
            if progress:
                _progress(verdicts[-1])
    return verdicts, report


def _progress(v: Verdict) -> None:
    print(f"[{'ok' if v.ok else 'FAIL'}] {v.probe} ({v.duration_s:.1f} s): {v.observed}", file=sys.stderr)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _interrupt(task: asyncio.Task[Any]) -> None:
    """SIGTERM while the probes run: cancel them (the stack is stopped on the way out)."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # cancelled gathers are expected now
    task.cancel()


def run(args: argparse.Namespace) -> int:
    try:
        probes, soak_only = _select(args.only)
    except ValueError as exc:
        print(f"kvgate bench abuse: {exc}", file=sys.stderr)
        return 2
    if soak_only and args.soak_minutes <= 0:
        print("kvgate bench abuse: --only soak needs --soak-minutes", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvgate-abuse-"))
    meta: dict[str, Any] = {**run_metadata(), "quick": sizes.quick, "load_average": os.getloadavg()}
    # SIGTERM unwinds like Ctrl-C, so that the processes of the stack are stopped on the way out.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        stack = start_stack(workdir, sizes)
    except Exception as exc:
        print(f"kvgate bench abuse: the stack did not start: {exc}\nlogs: {workdir}", file=sys.stderr)
        return 2
    try:
        verdicts, report = asyncio.run(_run(stack, sizes, probes, args, progress=not args.json))
    except asyncio.CancelledError:
        print(f"kvgate bench abuse: terminated; logs: {workdir}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        stack.stop()
    failed = [v for v in verdicts if not v.ok] or (report is not None and report.errors > 0)
    if args.json:
        doc = {
            "meta": meta,
            "probes": [v.as_json() for v in verdicts],
            "soak": report.as_json() if report is not None else None,
            "ok": not failed,
        }
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
    else:
        print(
            f"git {meta['git_sha']}, {'quick' if sizes.quick else 'full'} sizes, load average "
            f"{' '.join(f'{x:.2f}' for x in meta['load_average'])} at start\n"
        )
        if verdicts:
            print(table(verdicts))
        if report is not None:
            print("\n" + soak_text(report))
    if failed or args.workdir:
        print(f"logs: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0
