"""`kvgate bench goodput`: each policy's goodput capacity under per-trace SLOs, by bisection.

    kvgate bench goodput [--config FILE] [--traces A,B] [--policies P,Q] [--max-requests N]
        [--window-s S] [--seed S] [--out DIR] [--resume] [--quiet] [--suggest-slos]

For every trace of the config (shipped default: `loadtest/goodput/default.yaml`) and every policy:
replay the trace through the simulator at the reference rate, step the rate up or down by the
coarse factor until the SLO attainment crosses the share, then bisect to the tolerance
(`loadtest.goodput.search`). Each point is simulated once per run and appended to
`DIR/points.jsonl` with the git sha it was measured at; `--resume` reuses the points a previous run
recorded with the same settings, and the report names the shas its points come from. Writes
`DIR/report.md`, `DIR/goodput.json` and one plot per trace, and prints the tables (also when
matplotlib is missing).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import orjson

from loadtest.cli_args import UsageError, positive_float, positive_int
from loadtest.engine import ProfileError, StepProfile, load_profile
from loadtest.goodput.config import (
    GoodputConfig,
    GoodputConfigError,
    PolicyEntry,
    TraceSpec,
    as_entry,
    load_goodput_config,
)
from loadtest.goodput.report import TraceOutcome, run_document, trace_table
from loadtest.goodput.runner import PointResult, SimSettings, TraceSetup, prepare_trace, run_point
from loadtest.goodput.search import SearchSettings, find_capacity, round_rate, round_users
from loadtest.goodput.slo import figures_text, slo_figures
from loadtest.report.goodput_plots import CurvePoint, PlotUnavailable, goodput_curves
from loadtest.report.meta import run_metadata
from loadtest.traces.files import TraceFormatError
from policies.registry import known_policies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="goodput YAML (default: the shipped default.yaml), or a shipped one by name:"
        " pd, pd-tight-tpot, holder, objective, closed",
    )
    parser.add_argument("--traces", help="comma-separated subset of the config's traces")
    parser.add_argument(
        "--policies", help="comma-separated subset of the config's policies (rows, by label: 'cost 4:4')"
    )
    parser.add_argument(
        "--max-requests", type=positive_int, help="replay only the first N requests of each trace"
    )
    parser.add_argument(
        "--window-s", type=positive_float, help="replay only requests arriving within S s of the first"
    )
    parser.add_argument("--seed", type=int, help="override the config's seed")
    parser.add_argument("--out", default="bench-goodput", help="output directory (default bench-goodput)")
    parser.add_argument(
        "--resume", action="store_true", help="reuse the points DIR/points.jsonl holds for the same settings"
    )
    parser.add_argument("--quiet", action="store_true", help="no line per simulated point")
    parser.add_argument(
        "--suggest-slos",
        action="store_true",
        help="print the prompt sizes and step times the SLOs are derived from, and the SLOs they give",
    )


def _subset(given: str | None, available: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not given:
        return available
    chosen = tuple(x.strip() for x in given.split(",") if x.strip())
    unknown = [x for x in chosen if x not in available]
    if unknown:
        raise UsageError(f"unknown {what} {', '.join(unknown)}; the config has {', '.join(available)}")
    return chosen


def effective_config(args: argparse.Namespace) -> GoodputConfig:
    """The config file with the command line's subsets and overrides applied."""
    cfg = load_goodput_config(args.config)
    traces = _subset(args.traces, tuple(cfg.traces), "trace(s)")
    labels = _subset(args.policies, cfg.labels(), "policy(ies)")
    chosen = tuple(item for item, label in zip(cfg.policies, cfg.labels(), strict=True) if label in labels)
    unknown = [e.policy for e in map(as_entry, chosen) if e.policy not in known_policies()]
    if unknown:
        raise UsageError(f"unknown policy {', '.join(unknown)}; known: {', '.join(known_policies())}")
    sliced = args.max_requests is not None or args.window_s is not None
    by_users = [t for t in traces if cfg.traces[t].by_users]
    if sliced and by_users:
        names = ", ".join(by_users)
        raise UsageError(f"{names}: load: users replays whole users (no --max-requests, --window-s)")
    return cfg.model_copy(
        update={
            "traces": {t: cfg.traces[t] for t in traces},
            "policies": chosen,
            "baselines": tuple(b for b in cfg.baselines if b in labels),
            "seed": cfg.seed if args.seed is None else args.seed,
        }
    )


def fingerprint(cfg: GoodputConfig, trace: str, args: argparse.Namespace) -> str:
    """What a point's result depends on besides policy, rate and code: trace, slice, SLOs, settings.

    The code is not in it: each stored point carries the git sha it was measured at, and the
    report names every sha its points come from (rerun without `--resume` after changing the
    simulator or a policy)."""
    doc = {
        "trace": trace,
        "spec": cfg.traces[trace].model_dump(),
        "workers": cfg.workers,
        "profile": cfg.profile,
        "seed": cfg.seed,
        "scrape_interval_s": cfg.scrape_interval_s,
        "max_requests": args.max_requests,
        "window_s": args.window_s,
    }
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


PointKey = tuple[str, str, str, float]  # fingerprint, trace, policy, load (rate scale or users)


class PointStore:
    """Every simulated point of a run, appended to `points.jsonl` as it is measured, with the git
    sha it was measured at; with `resume`, the points of an earlier run with the same fingerprint
    are found again. `shas_used` are the shas of every point the run used."""

    def __init__(self, path: Path, resume: bool, git_sha: str) -> None:
        self.path = path
        self.git_sha = git_sha
        self.known: dict[PointKey, tuple[PointResult, str]] = {}
        self.shas_used: set[str] = set()
        if resume and path.is_file():
            for line in path.read_bytes().splitlines():
                row = orjson.loads(line)
                point = PointResult(**row["point"])
                key = (row["fingerprint"], row["trace"], row["policy"], row.get("load", point.rate_scale))
                self.known[key] = (point, row["git_sha"])
        elif path.exists():
            path.unlink()

    def get(self, key: PointKey) -> PointResult | None:
        found = self.known.get(key)
        if found is None:
            return None
        self.shas_used.add(found[1])
        return found[0]

    def put(self, key: PointKey, point: PointResult) -> None:
        self.known[key] = (point, self.git_sha)
        self.shas_used.add(self.git_sha)
        row = {
            "fingerprint": key[0],
            "trace": key[1],
            "policy": key[2],
            "load": key[3],
            "git_sha": self.git_sha,
            "point": asdict(point),
        }
        with self.path.open("ab") as f:
            f.write(orjson.dumps(row) + b"\n")


class UserSetups:
    """A closed-loop trace keyed as each number of users the search asks for (`load: users`):
    the starting one, and the last other one asked for. A keyed agent trace takes about 60 MB
    per user (its prompts' block keys), so no more are kept: the one given up goes before the
    next is keyed."""

    def __init__(self, base: TraceSetup, prepare: Callable[[TraceSpec], TraceSetup]) -> None:
        self.base = base
        self.prepare = prepare
        self.last: TraceSetup | None = None

    def at(self, users: int) -> TraceSetup:
        if users == self.base.spec.users:
            return self.base
        if self.last is None or self.last.spec.users != users:
            self.last = None
            self.last = self.prepare(self.base.spec.model_copy(update={"users": users}))
        return self.last


def measure_trace(
    setup: TraceSetup,
    cfg: GoodputConfig,
    store: PointStore,
    fp: str,
    *,
    quiet: bool,
    prepare: Callable[[TraceSpec], TraceSetup] | None = None,
) -> TraceOutcome:
    """Every policy's capacity on one trace (the reference load always replayed in full). With
    `load: users`, `prepare` keys the trace for each number of users the search tries."""
    spec: TraceSpec = setup.spec
    sim = SimSettings(cfg.workers, cfg.seed, cfg.scrape_interval_s)
    outcome = TraceOutcome(setup.name, spec, len(setup.requests))
    rounding = round_users if spec.by_users else round_rate
    reference = rounding(spec.reference_load)
    if spec.by_users and prepare is None:
        raise ValueError(f"trace {setup.name}: load: users needs the trace prepared per user count")
    users = UserSetups(setup, prepare) if prepare is not None and spec.by_users else None

    def setup_at(load: float) -> tuple[TraceSetup, float]:
        """The keyed trace and the rate scale of a point at `load`."""
        if users is None:
            return setup, load
        return users.at(int(load)), spec.reference_rate_scale

    for entry in cfg.entries():
        policy = entry.label
        points = outcome.points.setdefault(policy, {})

        def passes(
            load: float, entry: PolicyEntry = entry, points: dict[float, PointResult] = points
        ) -> bool:
            key = (fp, setup.name, entry.point_key, load)
            full = load == reference or not cfg.stop_early
            point = store.get(key)
            if point is None or (full and not point.complete):
                stop = None if full else cfg.attainment_share
                at, rate = setup_at(load)
                point = run_point(at, entry, rate, sim, stop_below_share=stop)
                store.put(key, point)
                if not quiet:
                    line = _progress(setup.name, entry.label, point, spec.by_users)
                    print(line, file=sys.stderr, flush=True)
            points[load] = point
            return point.passes(cfg.attainment_share)

        lo_bound, hi_bound = spec.load_bounds
        settings = SearchSettings(spec.reference_load, lo_bound, hi_bound, cfg.coarse_factor, cfg.tolerance)
        outcome.capacities[policy] = find_capacity(passes, settings, rounding, 1.0 if spec.by_users else 0.0)
    return outcome


def _progress(trace: str, policy: str, p: PointResult, by_users: bool) -> str:
    tail = (
        f"ttft p99 {p.ttft_p99_s:.2f}s  tpot p99 {(p.tpot_p99_s or 0.0) * 1e3:.0f}ms  "
        f"util {p.utilization:.2f}"
        if p.complete and p.ttft_p99_s is not None and p.utilization is not None
        else "stopped: below the share"
    )
    return (
        f"{trace} {policy:20s} rate {p.rate_scale:<8.4g} "
        + (f"users {p.users or 1:<4d} " if by_users else "")
        + f"attainment {p.attainment:.3f}  {tail}  "
        f"({p.wall_s:.0f}s)"
    )


def plot_outcome(outcome: TraceOutcome, cfg: GoodputConfig, path: Path) -> None:
    curves = {
        policy: [CurvePoint(load, p.attainment, p.ttft_p99_s, p.complete) for load, p in pts.items()]
        for policy, pts in outcome.points.items()
    }
    goodput_curves(
        f"{Path(outcome.name).name}: TTFT p99 and SLO attainment against rate",
        curves,
        ttft_slo_s=outcome.spec.ttft_slo_s,
        share=cfg.attainment_share,
        path=path,
        capacities={p: c.load for p, c in outcome.capacities.items()},
        load_label=(
            f"users (closed loop, think time ÷ {outcome.spec.reference_rate_scale:g}, log)"
            if outcome.spec.by_users
            else None
        ),
    )


def _suggest(cfg: GoodputConfig, profile: StepProfile, args: argparse.Namespace) -> int:
    for name, spec in cfg.traces.items():
        try:
            setup = prepare_trace(
                name, spec, profile, seed=cfg.seed, max_requests=args.max_requests, window_s=args.window_s
            )
        except (TraceFormatError, ValueError) as exc:
            print(f"kvgate bench goodput: error: {exc}", file=sys.stderr)
            return 2
        print(figures_text(name, slo_figures(setup)))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        cfg = effective_config(args)
        profile = load_profile(cfg.profile)
    except (GoodputConfigError, UsageError, ProfileError) as exc:
        print(f"kvgate bench goodput: error: {exc}", file=sys.stderr)
        return 2
    if args.suggest_slos:
        return _suggest(cfg, profile, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata()
    store = PointStore(out / "points.jsonl", args.resume, meta["git_sha"])
    outcomes: list[TraceOutcome] = []
    sections: list[str] = []
    plot_note: str | None = None
    for name, spec in cfg.traces.items():
        try:
            setup = prepare_trace(
                name, spec, profile, seed=cfg.seed, max_requests=args.max_requests, window_s=args.window_s
            )
        except (TraceFormatError, ValueError) as exc:
            print(f"kvgate bench goodput: error: {exc}", file=sys.stderr)
            return 2

        def prepare(spec: TraceSpec, name: str = name) -> TraceSetup:
            return prepare_trace(
                name, spec, profile, seed=cfg.seed, max_requests=args.max_requests, window_s=args.window_s
            )

        outcome = measure_trace(
            setup, cfg, store, fingerprint(cfg, name, args), quiet=args.quiet, prepare=prepare
        )
        outcomes.append(outcome)
        table = trace_table(outcome, cfg)
        sections.append(table)
        print(table + "\n", flush=True)
        if plot_note is None:
            try:
                plot_outcome(outcome, cfg, out / f"goodput-{Path(name).name}.png")
            except PlotUnavailable as exc:
                plot_note = str(exc)
                print(plot_note, file=sys.stderr)
    meta = {**meta, "points_measured_at": sorted(store.shas_used)}
    header = (
        f"kvgate bench goodput  git {meta['git_sha']} (points measured at "
        f"{', '.join(meta['points_measured_at'])})  seed {cfg.seed}  {cfg.workers} workers  "
        f"profile {cfg.profile}  share {cfg.attainment_share:g}  tolerance {cfg.tolerance:g}"
    )
    print(header)
    (out / "report.md").write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    doc = run_document(meta, cfg, outcomes)
    options = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    (out / "goodput.json").write_bytes(orjson.dumps(doc, option=options))
    print(f"wrote {out / 'report.md'} and {out / 'goodput.json'}" + ("" if plot_note else " and plots"))
    return 0
