"""The figures the per-trace SLOs are derived from (`kvgate bench goodput --suggest-slos`).

TTFT: twice the 90th percentile of each request's own prefill on an idle engine, given the hits an
infinite shared cache would give it (the trace's own reuse), rounded up to 0.1 s. At a 90 % share,
a router that placed every request on an idle worker holding its whole reusable prefix meets it
with as much time again to spare for queueing; a router that loses the reuse pays its longer
prefill out of that margin. Raw TTFT of the longest prompts (their own prefill) is what the share
leaves out.
TPOT: 0.1 s per output token (DistServe's chatbot objective); the profile's step times printed
beside it show where it binds: a step that carries a full prefill chunk takes about twice as long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.goodput.runner import TraceSetup

TPOT_SLO_S = 0.1
TTFT_FACTOR = 2.0
TTFT_PERCENTILE = 90.0


@dataclass(frozen=True, slots=True)
class SloFigures:
    """One trace's prompt sizes and modelled step times, and the SLOs they suggest."""

    prompt_p50_tokens: float
    prompt_p90_tokens: float
    own_prefill_p90_uncached_s: float
    own_prefill_p90_ideal_hits_s: float
    full_chunk_step_s: float
    decode_step_median_context_s: float
    ttft_slo_s: float
    tpot_slo_s: float


def ideal_hit_tokens(setup: TraceSetup) -> list[int]:
    """Each request's hit with one infinite shared cache, walking from block 0 in arrival order."""
    seen: set[int] = set()
    hits = []
    for kp in setup.keyed:
        chain = kp.chain()
        matched = 0
        for key in chain.keys:
            if key not in seen:
                break
            matched += 1
        hits.append(chain.hit_tokens(matched))
        seen.update(chain.keys)
    return hits


def slo_figures(setup: TraceSetup) -> SloFigures:
    prof = setup.profile
    n = np.array([kp.n_tokens for kp in setup.keyed], dtype=np.float64)
    hits = ideal_hit_tokens(setup)
    uncached = [prof.isolated_prefill_s(int(t)) for t in n]
    ideal = [prof.isolated_prefill_s(int(t) - h, h) for t, h in zip(n, hits, strict=True)]
    ideal_p90 = float(np.percentile(ideal, TTFT_PERCENTILE))
    chunk = prof.max_num_batched_tokens
    median = float(np.median(n))
    return SloFigures(
        prompt_p50_tokens=median,
        prompt_p90_tokens=float(np.percentile(n, 90)),
        own_prefill_p90_uncached_s=float(np.percentile(uncached, TTFT_PERCENTILE)),
        own_prefill_p90_ideal_hits_s=ideal_p90,
        full_chunk_step_s=prof.step_time_s(chunk + 1, 2, int(median), chunk * chunk / 2.0),
        decode_step_median_context_s=prof.step_time_s(1, 1, int(median), 0.0),
        ttft_slo_s=math.ceil(TTFT_FACTOR * ideal_p90 * 10 - 1e-9) / 10,
        tpot_slo_s=TPOT_SLO_S,
    )


def figures_text(name: str, f: SloFigures) -> str:
    return (
        f"{name}: prompt p50 {f.prompt_p50_tokens:,.0f} p90 {f.prompt_p90_tokens:,.0f} tokens; "
        f"own prefill p90 {f.own_prefill_p90_uncached_s:.3f} s uncached, "
        f"{f.own_prefill_p90_ideal_hits_s:.3f} s with the trace's own reuse; "
        f"step with a full prefill chunk + one decode at median context {f.full_chunk_step_s * 1e3:.0f} ms, "
        f"one decode alone {f.decode_step_median_context_s * 1e3:.1f} ms -> "
        f"ttft_slo_s {f.ttft_slo_s:g}, tpot_slo_s {f.tpot_slo_s:g}"
    )
