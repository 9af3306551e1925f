"""The goodput report: one markdown table per trace, and the JSON document of a run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.goodput.config import GoodputConfig, TraceSpec
from loadtest.goodput.runner import PointResult
from loadtest.goodput.search import Capacity

SUBJECT_GOAL = 1.3  # the subject's capacity against the best other policy's


@dataclass(slots=True)
class TraceOutcome:
    """Everything measured on one trace: every point per policy (load → result) and each
    policy's capacity bracket."""

    name: str
    spec: TraceSpec
    n_requests: int
    points: dict[str, dict[float, PointResult]] = field(default_factory=dict)
    capacities: dict[str, Capacity] = field(default_factory=dict)

    def at(self, policy: str, load: float | None) -> PointResult | None:
        return None if load is None else self.points.get(policy, {}).get(load)


def _f(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, spec)


def capacity_text(cap: Capacity, spec: TraceSpec) -> str:
    unit = "g" if spec.by_users else ".3g"  # whole users in full, rate scales to 3 digits
    if cap.load is None:
        return f"< {spec.load_bounds[0]:{unit}}"
    if cap.failing_load is None:
        return f"≥ {cap.load:{unit}}"
    return f"{cap.load:{unit}}"


def capacity_ratio(a: Capacity, b: Capacity) -> str:
    """a's capacity over b's; a bound on either side makes the ratio a bound too."""
    if a.load is None and b.load is None:
        return "–"
    if a.load is None:
        return "< 1" if b.load is not None else "–"
    if b.load is None:
        return "∞"
    ratio = a.load / b.load
    if a.failing_load is None and b.failing_load is not None:
        return f"≥ {ratio:.2f}×"
    if b.failing_load is None and a.failing_load is not None:
        return f"≤ {ratio:.2f}×"
    return f"{ratio:.2f}×"


def goal_text(a: Capacity, b: Capacity, goal: float | None = SUBJECT_GOAL) -> str:
    """a's capacity over b's at the passing loads, the range the two search brackets allow, and
    whether that range clears `goal` (met), stays below it (missed) or straddles it; no verdict
    when there is no goal."""
    if a.load is None:
        return "no capacity" + (f" (goal ≥ {goal:g}×: missed)" if goal is not None else "")
    if b.load is None:
        return "∞" + (f" (goal ≥ {goal:g}×: met)" if goal is not None else "")
    ratio = a.load / b.load
    low = a.load / b.failing_load if b.failing_load is not None else 0.0
    high = a.failing_load / b.load if a.failing_load is not None else math.inf
    if goal is None:
        return f"{ratio:.3f}× ({low:.2f}–{high:.2f}× within the search brackets)"
    verdict = "met" if low >= goal else "missed" if high < goal else "undecided within the brackets"
    return f"{ratio:.3f}× ({low:.2f}–{high:.2f}× within the search brackets; goal ≥ {goal:g}×: {verdict})"


def best_other(outcome: TraceOutcome, subject: str) -> str | None:
    """The policy other than `subject` with the highest capacity (None if none has one)."""
    others = [(c.load, p) for p, c in outcome.capacities.items() if p != subject and c.load is not None]
    return max(others)[1] if others else None


def trace_table(outcome: TraceOutcome, config: GoodputConfig) -> str:
    """The markdown table of one trace and the lines that read it against the goals."""
    spec = outcome.spec
    ref = spec.reference_load
    at = spec.load_text(ref)
    base = [b for b in config.baselines if b in outcome.capacities]
    unit = f"users, closed loop at {spec.reference_rate_scale:g}×" if spec.by_users else "rate scale"
    head = ["policy", f"goodput capacity ({unit})", *(f"vs {b}" for b in base)]
    head += ["TTFT p99 s at capacity", "TPOT p99 ms at capacity", "attainment at capacity"]
    head += [f"TTFT p99 s at {at}", f"TPOT p99 ms at {at}", f"utilization at {at}", "points"]
    of = f"{outcome.n_requests:,} requests" + (f" ({spec.users} users)" if spec.by_users else "")
    lines = [
        f"### {outcome.name}: TTFT ≤ {spec.ttft_slo_s:g} s and TPOT ≤ {spec.tpot_slo_s * 1e3:g} ms "
        f"for ≥ {config.attainment_share:.0%} of {of}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for policy, cap in outcome.capacities.items():
        at_cap = outcome.at(policy, cap.load)
        at_ref = outcome.at(policy, ref)
        n_stopped = sum(not p.complete for p in outcome.points[policy].values())
        cells = [policy, capacity_text(cap, spec)]
        cells += [capacity_ratio(cap, outcome.capacities[b]) if b != policy else "1.00×" for b in base]
        cells += [
            _f(at_cap.ttft_p99_s if at_cap else None, ".2f"),
            _f(at_cap.tpot_p99_s if at_cap else None, ".0f", 1e3),
            _f(at_cap.attainment if at_cap else None, ".3f"),
            _f(at_ref.ttft_p99_s if at_ref else None, ".2f"),
            _f(at_ref.tpot_p99_s if at_ref else None, ".0f", 1e3),
            _f(at_ref.utilization if at_ref else None, ".2f"),
            f"{len(outcome.points[policy])}" + (f" ({n_stopped} stopped)" if n_stopped else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_reading(outcome, config)]
    return "\n".join(lines)


def _reading(outcome: TraceOutcome, config: GoodputConfig) -> list[str]:
    out: list[str] = []
    spec = outcome.spec
    ref = spec.reference_load
    rr = outcome.at("round_robin", ref)
    if rr is not None and rr.utilization is not None:
        inside = "inside" if 0.70 <= rr.utilization <= 0.85 else "outside"
        at = spec.load_text(ref)
        out.append(f"- round_robin utilization at {at}: {rr.utilization:.2f} ({inside} the 70–85 % band)")
    subject = config.subject
    if subject not in outcome.capacities:
        return out
    other = best_other(outcome, subject)
    if other is not None:
        out.append(
            f"- {subject} against the best other policy ({other}): "
            + goal_text(outcome.capacities[subject], outcome.capacities[other], config.goal)
        )
    mine = outcome.at(subject, ref)
    rivals = {
        p: r.ttft_p99_s
        for p in outcome.capacities
        if p != subject and (r := outcome.at(p, ref)) is not None and r.ttft_p99_s is not None
    }
    if mine is not None and mine.ttft_p99_s is not None and rivals:
        best_p = min(rivals, key=lambda p: rivals[p])
        where = (
            "the lowest of all policies"
            if mine.ttft_p99_s <= rivals[best_p]
            else f"above {best_p}'s {rivals[best_p]:.2f} s"
        )
        out.append(f"- {subject} raw TTFT p99 at {spec.load_text(ref)}: {mine.ttft_p99_s:.2f} s, {where}")
    return out


def outcome_json(outcome: TraceOutcome) -> dict[str, Any]:
    return {
        "spec": outcome.spec.model_dump(),
        "n_requests": outcome.n_requests,
        "capacities": {p: asdict(c) for p, c in outcome.capacities.items()},
        "points": {p: [asdict(pt) for _, pt in sorted(pts.items())] for p, pts in outcome.points.items()},
    }


def run_document(
    meta: Mapping[str, Any], config: GoodputConfig, outcomes: Sequence[TraceOutcome]
) -> dict[str, Any]:
    """The JSON document of a run: metadata (git sha, time), the config, every trace's points."""
    return {
        "config": {**meta, "goodput": config.model_dump()},
        "traces": {o.name: outcome_json(o) for o in outcomes},
    }
