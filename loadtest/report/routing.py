"""Figures and the markdown report of one routing benchmark run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest.report.sampler import LoadSample
from loadtest.traces.http_replay import HttpResult


@dataclass
class RouterRun:
    """One router's turn: its status ("ok", "missing", "failed") and what was measured."""

    name: str
    status: str
    detail: str = ""
    results: list[HttpResult] = field(default_factory=list)
    load: list[LoadSample] = field(default_factory=list)
    worker_prompt_tokens: list[float] = field(default_factory=list)
    worker_hit_tokens: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def router_summary(run: RouterRun) -> dict[str, Any]:
    ok = [r for r in run.results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=np.float64)
    e2e = np.array([r.e2e_s for r in ok if r.e2e_s is not None], dtype=np.float64)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_req = [r.cached_tokens / r.prompt_tokens for r in ok if r.prompt_tokens]
    wp = np.array(run.worker_prompt_tokens, dtype=np.float64)
    wh = np.array(run.worker_hit_tokens, dtype=np.float64)
    return {
        "status": run.status,
        "detail": run.detail,
        "n_sent": len(run.results),
        "n_ok": len(ok),
        "n_errors": len(run.results) - len(ok),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": float(ttft.mean()) if ttft.size else None,
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99),
        "hit_ratio": cached / prompt if prompt else None,
        "request_hit_ratio": float(np.mean(per_req)) if per_req else None,
        "worker_prompt_tokens": run.worker_prompt_tokens,
        "worker_hit_ratio": float(wh.sum() / wp.sum()) if wp.size and wp.sum() else None,
        # Imbalance of work actually computed (prompt tokens minus hits) across workers.
        "imbalance": float((wp - wh).max() / (wp - wh).mean()) if wp.size and (wp - wh).mean() > 0 else None,
        "wall_s": run.wall_s,
    }


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown_report(
    config: dict[str, Any],
    summaries: dict[str, dict[str, Any]],
    ceilings: dict[str, float],
    baseline: str | None,
    *,
    plots: bool = True,
) -> str:
    """The report; `plots`: whether the PNGs were written (matplotlib installed), so linked."""
    lines = ["# Routing benchmark", ""]
    lines.append("Config: " + ", ".join(f"`{k}={v}`" for k, v in config.items()))
    lines.append("")
    lines.append(
        f"Ceilings over the same requests: infinite cache {ceilings['infinite']:.3f}, "
        f"pooled LRU of the cluster's capacity {ceilings['pooled_lru']:.3f}."
    )
    lines.append("")
    lines.append(
        "| router | status | ok/sent | TTFT p50 s | TTFT p99 s | TTFT mean s | e2e p99 s | hit ratio | "
        "hit/ceiling | imbalance | TTFT p50 vs baseline |"
    )
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = summaries.get(baseline or "", {})
    for name, s in summaries.items():
        if s["status"] != "ok":
            lines.append(f"| {name} | {s['status']}: {s['detail'][:120]} | | | | | | | | | |")
            continue
        ratio = None
        if base.get("ttft_p50_s") and s["ttft_p50_s"]:
            ratio = s["ttft_p50_s"] / base["ttft_p50_s"]
        hit = s["hit_ratio"]
        of_ceiling = hit / ceilings["infinite"] if hit is not None and ceilings["infinite"] else None
        lines.append(
            f"| {name} | ok | {s['n_ok']}/{s['n_sent']} | {_f(s['ttft_p50_s'])} | {_f(s['ttft_p99_s'])} | "
            f"{_f(s['ttft_mean_s'])} | {_f(s['e2e_p99_s'])} | {_f(hit)} | {_f(of_ceiling)} | "
            f"{_f(s['imbalance'], 2)} | {_f(ratio, 2)}x |"
        )
    lines += ["", f"Baseline for ratios: `{baseline}`.", ""]
    if plots:
        lines += [
            "![TTFT CDF](ttft_cdf.png)",
            "",
            "![hit ratio](hit_ratio.png)",
            "",
            "![load](load_over_time.png)",
            "",
        ]
    else:
        lines += ["Plots skipped: matplotlib is not installed (`pip install 'kvgate[bench]'`).", ""]
    return "\n".join(lines)


def ok_runs(runs: Sequence[RouterRun]) -> list[RouterRun]:
    return [r for r in runs if r.status == "ok"]
