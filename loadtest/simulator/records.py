"""Per-request results of a simulation run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's fate. Times are virtual seconds from the start of the trace.

    `ttft_s`, `tpot_s`, `e2e_s` are None for a request no worker could take (`worker` None). `tpot_s`
    is the mean time between output tokens after the first (None with one output token).
    `predicted_cached_tokens` is what the policy expected to hit (`RouteDecision.matched_tokens`).
    """

    request_id: str
    tenant: str
    session: str
    worker: str | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    predicted_cached_tokens: int
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker's totals over the run."""

    worker: str
    n_requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    output_tokens: int
    busy_s: float
    n_steps: int
