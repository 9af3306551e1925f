"""The tables `kvgate bench overhead` prints: per target, throughput, latency and CPU per request
with the same-round CPU ratio to its baseline; then where the machine's cores went during the
runs at the highest concurrency.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from loadtest.overhead_runner import BenchConfig, CpuShare, TargetResult, cpu_ratio
from prompt_normalizer.bench import git_sha

SMG_BASELINE = "smg cache_aware"  # the second CPU ratio's baseline, when it ran


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row(r: TargetResult, by_name: dict[str, TargetResult], hi: int, lo: int) -> str:
    if r.missing is not None:
        return f"| {r.name} | missing: {r.missing} |"
    a, b = r.at(hi), r.at(lo)
    base = by_name.get(r.baseline) if r.baseline else None
    base_run = base.at(hi) if base is not None and base.missing is None else None
    ratio = "-"
    paired = cpu_ratio(r, base, hi) if base is not None and base_run is not None else None
    if paired is not None:
        ratio = f"{paired:.2f}x {r.baseline}"
    measured = [c for c in r.cpu_rounds(hi) if c is not None]
    rounds = ", ".join(format(c, ".0f") for c in measured) if len(measured) > 1 else "-"
    direct = by_name.get("direct")
    d = direct.at(lo) if direct is not None and direct.missing is None else None
    added = b.p50_ms - d.p50_ms if b and d and r is not direct else None
    cells = [
        r.name,
        _fmt(a.rps if a else None, ",.0f"),
        _fmt(a.p50_ms if a else None, ".2f"),
        _fmt(a.p99_ms if a else None, ".2f"),
        _fmt(a.cpu_us_per_request if a else None, ".0f"),
        rounds,
        ratio,
        *_smg_ratio(r, by_name, hi),
        _fmt(b.p50_ms if b else None, ".3f"),
        _fmt(b.p99_ms if b else None, ".3f"),
        _fmt(added, "+.3f"),
        str(sum(x.errors for x in r.runs)),
    ]
    return "| " + " | ".join(cells) + " |"


def _smg_ran(by_name: dict[str, TargetResult]) -> bool:
    smg = by_name.get(SMG_BASELINE)
    return smg is not None and smg.missing is None and bool(smg.runs)


def _smg_ratio(r: TargetResult, by_name: dict[str, TargetResult], hi: int) -> list[str]:
    """The CPU ratio against smg cache_aware (same-round pairs), as a cell when smg ran."""
    if not _smg_ran(by_name):
        return []
    if r.name == SMG_BASELINE:
        return ["1.00x"]
    paired = cpu_ratio(r, by_name[SMG_BASELINE], hi)
    return [_fmt(paired, ".2f") + ("x" if paired is not None else "")]


def report(results: Sequence[TargetResult], cfg: BenchConfig, backend_name: str) -> str:
    by_name = {r.name: r for r in results}
    hi, lo = max(cfg.concurrencies), min(cfg.concurrencies)
    smg_col = " CPU vs smg cache_aware |" if _smg_ran(by_name) else ""
    lines = [
        f"kvgate bench overhead  git {git_sha()}  seed {cfg.seed}  load: {cfg.load_tool}",
        f"backend: {backend_name}",
        f"{cfg.duration_s:g}s per concurrency after {cfg.warmup_s:g}s warm-up, {cfg.repeats} round(s), "
        "medians; CPU = router process tree; CPU ratio = median over rounds of the same-round ratio",
        "",
        f"| target | c={hi} req/s | p50 ms | p99 ms | CPU µs/req | per round | CPU ratio |{smg_col} "
        f"c={lo} p50 ms | p99 ms | added p50 ms vs direct | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if smg_col else ""),
    ]
    lines += [_row(r, by_name, hi, lo) for r in results]
    lines += cpu_report(results, hi)
    return "\n".join(lines)


def _median_share(shares: Sequence[CpuShare]) -> dict[str, float]:
    return {
        "router": statistics.median(s.router for s in shares),
        "backend": statistics.median(s.backend for s in shares),
        "load": statistics.median(s.load_generator for s in shares),
        "others": statistics.median(s.others for s in shares),
        "machine": statistics.median(s.machine for s in shares),
    }


def cpu_report(results: Sequence[TargetResult], hi: int) -> list[str]:
    """Cores (CPU seconds per wall second, medians over rounds) at c=`hi`: the router's tree, its
    processes (last round), the backend, the load generator, the rest of the machine; req/s per
    router core; and, for a target whose baseline is another kvgate target (`x N processes`), its
    req/s and router cores against the baseline's, paired by round. A router process that is not
    CPU-bound leaves its core partly idle; one that is gets about one core, less what the backend,
    the load generator and other jobs take. When req/s grows with the router's cores at an equal
    rate per core, the processes scale and what is missing is CPU."""
    by_name = {r.name: r for r in results}
    rows = [(r, r.shares(hi)) for r in results if r.missing is None]
    rows = [(r, s) for r, s in rows if s and any(x.router > 0 for x in s)]
    if not rows:
        return []
    lines = [
        "",
        f"CPU at c={hi}, cores (medians over rounds); router processes from the last round",
        "",
        "| target | router | router processes | backend | load generator | others | machine busy "
        "| req/s per router core | req/s, router cores vs baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, shares in rows:
        m = _median_share(shares)
        run = r.at(hi)
        procs = ", ".join(
            f"{name} {cores:.2f}" for name, cores in shares[-1].router_processes if cores >= 0.01
        )
        per_core = run.rps / m["router"] if run is not None and m["router"] > 0 else None
        cells = [
            r.name,
            f"{m['router']:.2f}",
            procs or "-",
            f"{m['backend']:.2f}",
            f"{m['load']:.2f}",
            f"{m['others']:.2f}",
            f"{m['machine']:.2f}",
            _fmt(per_core, ",.0f"),
            _scaling(r, by_name.get(r.baseline or ""), hi),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _paired(mine: Sequence[float], theirs: Sequence[float]) -> float | None:
    ratios = [a / b for a, b in zip(mine, theirs, strict=False) if b > 0]
    return statistics.median(ratios) if ratios else None


def _scaling(r: TargetResult, base: TargetResult | None, hi: int) -> str:
    """`req/s ×, router cores ×` against a kvgate baseline: medians of same-round ratios."""
    if base is None or not base.name.startswith("kvgate") or base.missing is not None:
        return "-"
    rps = _paired(
        [x.rps for x in r.runs if x.concurrency == hi], [x.rps for x in base.runs if x.concurrency == hi]
    )
    cores = _paired([s.router for s in r.shares(hi)], [s.router for s in base.shares(hi)])
    if rps is None or cores is None:
        return "-"
    return f"{rps:.2f}x, {cores:.2f}x"
