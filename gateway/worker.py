"""One upstream worker: its active health verdict, circuit breaker, load counters and the view
of it every routing decision reads.

Load counters are kept incrementally by the data path (`Worker.acquire` / `release`), never
recomputed by scanning requests. A worker seen up, or restarted in place (its metrics show a new
process), is due a read of its model cards (`window_due`, `model_window.py`), which its pool's
health round makes (`registry.Pool.check`).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable

from gateway.breaker import CircuitBreaker, TrialTicket
from gateway.config.pool import PoolConfig
from gateway.scrape import WorkerMetrics, worker_restarted
from gateway.upstream_address import direct_address
from policies.base import Role, WorkerId, WorkerView, decode_context_of, prefill_pairs
from policies.peer_sync import PeerLoad, with_peer_load

log = logging.getLogger("kvgate.registry")


class HealthChange(enum.Enum):
    """A change of a worker's active health verdict."""

    UP = "up"  # the first check that finds it up (it was unknown, or never up yet)
    DOWN = "down"  # it was up, and failed `failures_to_down` checks in a row
    BACK = "back"  # up again after having been down


HealthListener = Callable[[WorkerId, HealthChange], None]


class Worker:
    """One upstream worker. Invariants: counters never go below zero; `healthy` is the active
    check's verdict, `breaker` the passive one; a worker is routable only when both agree.

    Every request reads every worker's `WorkerView`, so the view is kept until something in it
    changes: each mutation bumps `_version`, and a view with metrics also expires when they go
    stale. A breaker that is not closed is asked afresh each time (its verdict depends on time).
    """

    __slots__ = (
        "_been_up",
        "_coming_until_s",
        "_fails",
        "_healthy",
        "_judged",
        "_metrics",
        "_oks",
        "_peer_load",
        "_role",
        "_version",
        "_view",
        "_view_until_s",
        "_view_version",
        "breaker",
        "decode_context",
        "decode_tokens",
        "direct",
        "in_flight",
        "in_flight_at_scrape",
        "max_in_flight",
        "metrics_at_s",
        "prefill_pairs",
        "prefill_started_s",
        "prefill_tokens",
        "url",
        "window_due",
        "worker_id",
    )

    def __init__(self, url: str, config: PoolConfig) -> None:
        self.url = url
        self.worker_id = WorkerId(url)
        self.direct = direct_address(url)
        self._version = 0
        self._view: WorkerView | None = None
        self._view_version = -1
        self._view_until_s = 0.0
        self._healthy = False  # unknown until the first check answers
        self._judged = False  # whether a verdict (up or down) was ever given
        health = config.health
        self._coming_until_s = time.monotonic() + health.successes_to_up * (
            health.interval_s + health.timeout_s
        )
        self._been_up = False
        self.breaker = CircuitBreaker(config.breaker)
        self.max_in_flight = config.max_in_flight_per_worker
        self.in_flight = 0
        self.prefill_tokens = 0
        self.prefill_pairs = 0  # see WorkerView.in_flight_prefill_pairs
        self.prefill_started_s: float | None = None  # see WorkerView.prefill_started_s
        self.decode_tokens = 0
        self.decode_context = 0  # see `decode_context_of`
        self._fails = 0
        self._oks = 0
        self._metrics: WorkerMetrics | None = None  # last scrape, set by the scraper's callback
        self.metrics_at_s = 0.0
        self.in_flight_at_scrape = 0  # this gateway's and its peers' requests when it was scraped
        self._role: str | None = None
        self._peer_load: PeerLoad | None = None  # other gateways' in-flight here (replica sync)
        # Seen up or restarted since its model cards were last read (`Pool.check` reads them).
        self.window_due = False

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._healthy = value
        self._judged = True
        self._version += 1

    def coming(self, now_s: float) -> bool:
        """New to the pool and not judged yet: discovery (or the start) added it, no health check
        has said it is down (those that answered passed, short of `successes_to_up`), and its
        first checks' time is not over (`successes_to_up` × (`interval_s` + `timeout_s`)). The
        pool's queue waits for such a worker as for a busy one: its capacity is about to come."""
        return not self._judged and self._fails == 0 and now_s < self._coming_until_s

    @property
    def role(self) -> str | None:
        """The worker's role label (config or discovery): prefill, decode, mixed; None if unlabelled."""
        return self._role

    @role.setter
    def role(self, value: str | None) -> None:
        if value != self._role:
            self._role = value
            self._version += 1

    @property
    def metrics(self) -> WorkerMetrics | None:
        return self._metrics

    def note_metrics(self, metrics: WorkerMetrics | None, scraped_at_s: float) -> None:
        """A scrape's result (None: the worker exposes no metrics)."""
        before = self._metrics
        if before is not None and metrics is not None and worker_restarted(before, metrics):
            self.window_due = True  # a new process may serve another context window
        self._metrics = metrics
        self.metrics_at_s = scraped_at_s
        peers = self._peer_load.requests if self._peer_load is not None else 0
        self.in_flight_at_scrape = self.in_flight + peers
        self._version += 1

    def note_peer_load(self, load: PeerLoad | None) -> None:
        """Other gateways' summed in-flight load on this worker (None: none), from replica sync."""
        self._peer_load = load
        self._version += 1

    def view(self, now_s: float, metrics_max_age_s: float = 5.0) -> WorkerView:
        view = self._view
        if (
            view is not None
            and self._view_version == self._version
            and now_s < self._view_until_s
            and self.breaker.closed
        ):
            return view
        view = self._build_view(now_s, metrics_max_age_s)
        if not self.breaker.closed:
            self._view = None  # the breaker's verdict changes with time and outcomes: no reuse
            return view
        self._view = view
        self._view_version = self._version
        fresh = self._metrics is not None and now_s - self.metrics_at_s <= metrics_max_age_s
        self._view_until_s = self.metrics_at_s + metrics_max_age_s if fresh else math.inf
        return view

    def _build_view(self, now_s: float, metrics_max_age_s: float) -> WorkerView:
        m = self._metrics
        if m is not None and now_s - self.metrics_at_s > metrics_max_age_s:
            m = None  # stale: the policy sees only the gateway's own accounting
        view = WorkerView(
            worker_id=self.worker_id,
            healthy=self.healthy and self.breaker.allows(now_s),
            in_flight_requests=self.in_flight,
            in_flight_prefill_tokens=self.prefill_tokens,
            in_flight_prefill_pairs=self.prefill_pairs,
            in_flight_decode_tokens=self.decode_tokens,
            max_in_flight=self.max_in_flight,
            num_requests_waiting=m.num_requests_waiting if m else None,
            num_requests_running=m.num_requests_running if m else None,
            kv_usage=m.kv_cache_usage if m else None,
            num_gpu_blocks=m.num_gpu_blocks if m else None,
            engine_block_size=m.block_size_tokens if m else None,
            role=Role.of(self._role),
            in_flight_at_scrape=self.in_flight_at_scrape if m else None,
            decode_context_tokens=self.decode_context,
            prefill_started_s=self.prefill_started_s,
        )
        return view if self._peer_load is None else with_peer_load(view, self._peer_load)

    def acquire(
        self, prompt_tokens: int, max_output_tokens: int, now_s: float, matched_tokens: int = 0
    ) -> TrialTicket | None:
        """A request is dispatched here; `matched_tokens`: the cached tokens its decision predicted.
        The breaker's half-open trial it took, if any, is returned, for its verdict (`Attempt.end`)."""
        self._version += 1
        self.in_flight += 1
        if self.prefill_tokens <= 0 < prompt_tokens:
            self.prefill_started_s = now_s
        self.prefill_tokens += prompt_tokens
        self.prefill_pairs += prefill_pairs(prompt_tokens, matched_tokens)
        self.decode_tokens += max_output_tokens
        return self.breaker.on_dispatch(now_s)

    def reserve(self, max_output_tokens: int, now_s: float) -> TrialTicket | None:
        """Hold a slot for a leg sent later: a vLLM pair's decode leg, which goes out once the
        prefill leg has answered, is this worker's from the moment the pair is chosen, so neither
        the pool's queue nor the policy sees the slot free meanwhile. The breaker's half-open trial
        it took, if any, is returned (`unreserve` then gives that back too).

        A reservation is a request in flight and output this worker will decode, so it counts in
        `in_flight` and `decode_tokens`; its prompt is being computed on the prefill worker and
        weighs on that worker's prefill backlog only (counted here too, the policy would see a
        prefill queue on this worker that is not there). The leg's own `acquire` replaces it."""
        self._version += 1
        self.in_flight += 1
        self.decode_tokens += max_output_tokens
        return self.breaker.on_dispatch(now_s)

    def unreserve(self, max_output_tokens: int, trial: TrialTicket | None) -> None:
        """Give back what `reserve` took (the leg starts, or will not be sent)."""
        self._version += 1
        self.in_flight = max(0, self.in_flight - 1)
        self.decode_tokens = max(0, self.decode_tokens - max_output_tokens)
        self.breaker.on_abandon(trial=trial)

    def first_token(
        self,
        prompt_tokens: int,
        max_output_tokens: int = 0,
        *,
        matched_tokens: int = 0,
        now_s: float | None = None,
    ) -> None:
        """Prefill is done: the prompt no longer weighs on the worker's prefill queue, its context
        joins the decode batch, and the prompts still pending are worked on from now at the
        earliest (None: when is not known). `matched_tokens` as given to `acquire`."""
        self._version += 1
        self._prefill_done(prompt_tokens, matched_tokens)
        self.prefill_started_s = now_s if self.prefill_tokens > 0 else None
        self.decode_context += decode_context_of(prompt_tokens, max_output_tokens)

    def release(
        self, prompt_tokens: int, max_output_tokens: int, prefill_done: bool, matched_tokens: int = 0
    ) -> None:
        self._version += 1
        self.in_flight = max(0, self.in_flight - 1)
        if prefill_done:
            context = decode_context_of(prompt_tokens, max_output_tokens)
            self.decode_context = max(0, self.decode_context - context)
        else:
            self._prefill_done(prompt_tokens, matched_tokens)
            # The engine may have spent the time since on the prompt that left: count no progress
            # on the rest until the backlog next restarts.
            self.prefill_started_s = None
        self.decode_tokens = max(0, self.decode_tokens - max_output_tokens)

    def _prefill_done(self, prompt_tokens: int, matched_tokens: int) -> None:
        self.prefill_tokens = max(0, self.prefill_tokens - prompt_tokens)
        self.prefill_pairs = max(0, self.prefill_pairs - prefill_pairs(prompt_tokens, matched_tokens))

    def record_health(self, ok: bool, config: PoolConfig) -> HealthChange | None:
        """Count one check's answer; return the change of verdict it made, if any."""
        if ok:
            self._oks += 1
            self._fails = 0
            if not self.healthy and self._oks >= config.health.successes_to_up:
                self.healthy = True
                self.window_due = True
                log.info("worker up", extra={"worker": self.url})
                change = HealthChange.BACK if self._been_up else HealthChange.UP
                self._been_up = True
                return change
        else:
            self._fails += 1
            self._oks = 0
            # An unknown worker goes down on its first failed check; a known-good one needs a streak.
            if self.healthy and self._fails >= config.health.failures_to_down:
                self.healthy = False
                log.warning("worker down", extra={"worker": self.url})
                return HealthChange.DOWN
        return None
