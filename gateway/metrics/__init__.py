"""Prometheus metrics of one gateway process (own registry, so tests can build several apps).

`catalogue` declares every exported family (name, labels, help, buckets) in page order;
`families` holds the counter and histogram types the request path writes without locks; this
module's `GatewayMetrics` adds the writes several modules share and renders the page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import generate_latest

from gateway.metrics.catalogue import MetricCatalogue
from gateway.metrics.families import CounterChild, HistogramChild
from policies.base import Outcome


class GatewayMetrics(MetricCatalogue):
    """The catalogue's families, the writes several modules share (a finished or refused request,
    a routing decision, the end of an attempt on a worker) and the rendered page. Series labelled
    by worker are dropped when the worker leaves its pool (`forget_workers`), so discovery's churn
    does not grow them."""

    def __init__(self) -> None:
        super().__init__()
        # Called at scrape time, before rendering: gauges that are cheaper to read than to keep.
        self.before_scrape: list[Callable[[], None]] = []
        # The children of one (model, tenant), fetched together. Label values come from the config
        # (and a small set of statuses), so every map of children stays bounded.
        self._per_model: dict[tuple[str, str], _ModelChildren] = {}

    def rejected(self, endpoint: str, status: int, tenant: str = "", model: str = "") -> None:
        """A request refused before admission: its tenant once its key was known and its model
        once it was resolved to a served one (configured names both, so the labels stay
        bounded); empty before that."""
        self.requests.labels(model, tenant, str(status), endpoint).inc()

    def observe(
        self,
        *,
        model: str,
        tenant: str,
        endpoint: str,
        status: int,
        duration_s: float,
        ttft_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        self.requests.labels(model, tenant, str(status), endpoint).inc()
        children = self._per_model.get((model, tenant))
        if children is None:
            children = _ModelChildren(
                self.duration.labels(model),
                self.ttft.labels(model),
                self.prompt_tokens.labels(model, tenant),
                self.cached_tokens.labels(model, tenant),
                self.completion_tokens.labels(model, tenant),
            )
            self._per_model[(model, tenant)] = children
        children.duration.observe(duration_s)
        if ttft_s is not None:
            children.ttft.observe(ttft_s)
        # Counters only go up: a count below zero (no count: `answer_usage`) adds nothing.
        if prompt_tokens and prompt_tokens > 0:
            children.prompt.inc(prompt_tokens)
        if cached_tokens and cached_tokens > 0:
            children.cached.inc(cached_tokens)
        if completion_tokens and completion_tokens > 0:
            children.completion.inc(completion_tokens)

    def decision(self, policy: str, reason: str) -> None:
        self.decisions.labels(policy, reason).inc()

    def worker_outcome(self, pool: str, worker: str, outcome: Outcome) -> None:
        """One attempt on `worker` ended (`outcome.Attempt.end`)."""
        self.worker_requests.labels(pool, worker, _OUTCOME_LABELS[outcome]).inc()

    def time_per_output_token(self, model: str, seconds: float) -> None:
        self.tpot.labels(model).observe(seconds)

    def forget_workers(self, current: set[tuple[str, str]]) -> None:
        """Drop the per-worker series of every (pool, worker) not in `current`."""
        children = self.worker_requests.children
        for labels in [k for k in children if (k[0], k[1]) not in current]:
            del children[labels]

    def render(self) -> bytes:
        for refresh in self.before_scrape:
            refresh()
        return generate_latest(self.registry)


# Each outcome's label: an enum member's `.value` is a descriptor call (~0.2 µs), once per attempt.
_OUTCOME_LABELS = {outcome: outcome.value for outcome in Outcome}


@dataclass(frozen=True, slots=True)
class _ModelChildren:
    duration: HistogramChild
    ttft: HistogramChild
    prompt: CounterChild
    cached: CounterChild
    completion: CounterChild
