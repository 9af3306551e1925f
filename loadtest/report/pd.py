"""The `kvgate bench pd` table: medians over repeats, and ratios to a reference router taken within
each repeat (so the machine's load in one round cancels out) before their median is shown."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

COLUMNS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "prefill_hit_ratio",
    "reported_hit_ratio",
    "split_share",
    "n_errors",
)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def aggregate(
    summaries: Sequence[dict[str, Any]], routers: Sequence[str]
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Per router: the median of each column over its successful repeats, and the median over
    repeats of its ratio to the first smg router of the same repeat."""
    ref = next((r for r in routers if r.startswith("smg")), None)
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for s in summaries:
        if s["status"] == "ok":
            by_repeat.setdefault(s["repeat"], {})[s["router"]] = s
    table: dict[str, dict[str, Any]] = {}
    for router in routers:
        mine = [rows[router] for rows in by_repeat.values() if router in rows]
        row: dict[str, Any] = {"repeats": len(mine)}
        for col in COLUMNS:
            row[col] = _median([m[col] for m in mine])
            row[f"{col}_each"] = [m[col] for m in mine]
            if ref is not None and col not in ("n_errors", "split_share"):
                ratios = [
                    rows[router][col] / rows[ref][col]
                    for rows in by_repeat.values()
                    if router in rows and ref in rows and rows[router][col] and rows[ref][col]
                ]
                row[f"{col}_vs_ref"] = _median(ratios)
        row["failed_transfers"] = _median([m["failed_transfers"] for m in mine])
        shares = [m["split_share"] for m in mine if m["split_share"] is not None]
        row["split_share_min"] = min(shares) if shares else None
        row["n_sent"] = _median([m["n_sent"] for m in mine])
        table[router] = row
    return table, ref


def fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, spec)


def markdown_table(table: dict[str, dict[str, Any]], ref: str | None) -> str:
    vs = f"vs {ref}" if ref else ""
    head = ["router", "TTFT p50 s", "TTFT p99 s", "TPOT p99 ms", "prefill hit ratio", "reported hit ratio"]
    head += ["split share (lowest round)", "errors", "repeats"]
    if ref:
        head += [f"TTFT p50 {vs}", f"TTFT p99 {vs}", f"TPOT p99 {vs}", f"hit ratio {vs}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for router, row in table.items():
        cells = [
            router,
            fmt(row["ttft_p50_s"], ".3f"),
            fmt(row["ttft_p99_s"], ".3f"),
            fmt(row["tpot_p99_s"], ".1f", 1e3),
            fmt(row["prefill_hit_ratio"], ".3f"),
            fmt(row["reported_hit_ratio"], ".3f"),
            fmt(row["split_share_min"], ".3f"),
            fmt(row["n_errors"], "g"),
            str(row["repeats"]),
        ]
        if ref:
            for col in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "prefill_hit_ratio"):
                cells.append(fmt(row.get(f"{col}_vs_ref"), ".2f") + ("×" if row.get(f"{col}_vs_ref") else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
