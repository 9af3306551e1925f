"""Summary figures of a run, computed over request records (numpy, no per-token work).

The split: the first tenth of the requests by arrival (cold start, caches filling) and the rest
(steady state) are summarised separately with the same fields as the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from loadtest.simulator.records import RequestRecord, WorkerRecord

# Bucket edges of the hit-length histogram (cached tokens per request), upper bounds exclusive.
HIT_LENGTH_EDGES = (1, 512, 2048, 8192, 32768, 131072)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def hit_length_histogram(cached: np.ndarray) -> dict[str, int]:
    """Counts of requests by cached tokens: "0", "1-511", ..., ">=131072"."""
    out: dict[str, int] = {}
    lo = 0
    for hi in HIT_LENGTH_EDGES:
        label = "0" if (lo, hi) == (0, 1) else f"{lo}-{hi - 1}"
        out[label] = int(((cached >= lo) & (cached < hi)).sum())
        lo = hi
    out[f">={lo}"] = int((cached >= lo).sum())
    return out


def request_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Latency and hit figures over a set of requests (the fields shared by whole run and the split)."""
    done = [r for r in records if r.ttft_s is not None]
    ttft = np.array([r.ttft_s for r in done], dtype=np.float64)
    tpot = np.array([r.tpot_s for r in done if r.tpot_s is not None], dtype=np.float64)
    e2e = np.array([r.e2e_s for r in done], dtype=np.float64)
    prompt = np.array([r.prompt_tokens for r in done], dtype=np.float64)
    cached = np.array([r.cached_tokens for r in done], dtype=np.float64)
    per_request = cached[prompt > 0] / prompt[prompt > 0]
    return {
        "n_requests": len(records),
        "n_completed": len(done),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": _mean(ttft),
        "tpot_mean_s": _mean(tpot),
        "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99),
        "prompt_tokens": int(prompt.sum()),
        "cached_tokens": int(cached.sum()),
        "hit_ratio": float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0,
        "request_hit_ratio": _mean(per_request),
        "hit_length_p50_tokens": _pct(cached, 50),
        "hit_length_p90_tokens": _pct(cached, 90),
        "hit_length_histogram": hit_length_histogram(cached),
    }


def summarize(
    records: Sequence[RequestRecord],
    workers: Sequence[WorkerRecord],
    *,
    ceiling_infinite: float,
    ceiling_pooled_lru: float,
) -> dict[str, Any]:
    """The `summary` object of the simulator's JSON (documented in docs/benchmarks.md)."""
    ordered = sorted(records, key=lambda r: (r.arrival_s, r.request_id))
    figures = request_figures(ordered)
    done = [r for r in ordered if r.finish_s is not None]
    start_s = ordered[0].arrival_s if ordered else 0.0
    end_s = max((r.finish_s for r in done if r.finish_s is not None), default=start_s)
    makespan_s = max(end_s - start_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prefill = np.array([w.prefill_tokens for w in workers], dtype=np.float64)
    busy = np.array([w.busy_s for w in workers], dtype=np.float64)
    n_cold = max(1, len(ordered) // 10) if ordered else 0
    hit = figures["hit_ratio"]
    return {
        **figures,
        "makespan_s": makespan_s,
        "throughput_tok_s": output_tokens / makespan_s,
        "prefill_throughput_tok_s": float(prefill.sum()) / makespan_s,
        "ceiling_infinite": ceiling_infinite,
        "ceiling_pooled_lru": ceiling_pooled_lru,
        "hit_ratio_of_ceiling": hit / ceiling_infinite if ceiling_infinite else None,
        "imbalance": float(prefill.max() / prefill.mean()) if prefill.size and prefill.mean() > 0 else 1.0,
        "utilization": float(busy.mean() / makespan_s) if busy.size else 0.0,
        "utilization_max": float(busy.max() / makespan_s) if busy.size else 0.0,
        "n_rejected": sum(1 for r in ordered if r.worker is None),
        "cold_start": request_figures(ordered[:n_cold]),
        "steady_state": request_figures(ordered[n_cold:]),
    }
