"""Everything one gateway process shares between requests, built once from the config and
handed out as the few narrow objects each part of the request path uses."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.answer_budget import AnswerBudget
from gateway.auth import KeyRing
from gateway.config import GatewayConfig
from gateway.config.pool import read_worker_key
from gateway.decision_log import DecisionLog
from gateway.gate import Gate
from gateway.keying import Keying
from gateway.lifecycle import Lifecycle
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.queueing import build_queues
from gateway.quotas import TenantLimiter, restarted_after_s_of
from gateway.registry import Registry
from gateway.responses_affinity import ResponseAffinity
from gateway.responses_ids import ResponseIds
from gateway.routing import Routing
from gateway.stream_body import StreamBuffers
from gateway.tracing import TRACE_CONTEXT_HEADERS, RequestTracer
from gateway.transport import StoredPlaces, Transport
from gateway.upstream_conn import MAX_ANSWER_BYTES
from gateway.upstream_headers import WorkerAuth
from policies.base import RoutingPolicy
from policies.config import PolicyConfig
from policies.pools import CarriesLearning
from prompt_normalizer.normalizer import NormalizerConfig

if TYPE_CHECKING:
    from gateway.canary import Canaries
    from gateway.fleet import Fleet
    from gateway.policy_watch import LoadedPolicy
    from gateway.sync.service import SyncService


log = logging.getLogger("kvgate.policy_watch")


@dataclass(slots=True)
class GatewayState:
    """The composition root: builds the narrow objects the request path is handed and owns them
    for the app's wiring (lifespan, admin, metrics, policy reloads). No request-path module takes
    the whole state: admission gets the `Gate`, dispatch and the books the `Routing`, the
    `Transport` and the `Lifecycle`. `fleet` and `sync` exist while the lifespan runs."""

    config: GatewayConfig
    registry: Registry
    secret: bytes
    gate: Gate
    routing: Routing
    transport: Transport
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    created_s: int = 0
    fleet: Fleet | None = None  # discovery, scraping and KV events, while the lifespan runs
    sync: SyncService | None = None  # replica sync (config `sync.url`), while the lifespan runs
    canaries: Canaries | None = None  # the breakers' canaries (`gateway/canary.py`), likewise

    def set_policy(self, policy: RoutingPolicy, normalizer: NormalizerConfig) -> list[str]:
        """Swap in a reloaded policy and rebuild the normalizers that follow the policy file. The
        new policy takes over what the running one learned of the pools whose prompts are keyed
        as before (`policies.pools.CarriesLearning`); returns those pools."""
        keying = self.gate.keying
        before = dict(keying.normalizers)
        keying.set_policy_normalizer(normalizer)
        kept: list[str] = []
        if isinstance(policy, CarriesLearning):
            same_keys = [name for name, n in keying.normalizers.items() if before.get(name) is n]
            try:
                kept = policy.carry_over(self.routing.policy, same_keys)
            except Exception:  # the swap goes on: the new policy learns from nothing, as it could
                log.exception("policy reload: taking over what was learned failed; starting afresh")
        previous = self.routing.swap(policy)
        if isinstance(previous, CarriesLearning) and previous is not policy:
            previous.retire()
        return kept


def build_state(
    config: GatewayConfig,
    secret: bytes,
    policy: RoutingPolicy,
    policy_normalizer: NormalizerConfig,
    environ: Mapping[str, str] | None = None,
) -> GatewayState:
    """The process state; the pools' worker API keys are read here (from `environ`, by default
    the process's environment), so a missing one is a `ConfigError` before anything runs."""
    now_s = time.monotonic()
    env = os.environ if environ is None else environ
    auth = {pool.name: WorkerAuth(read_worker_key(pool, env)) for pool in config.pools}
    # While tracing, each attempt carries its own span's trace context; a client's is not forwarded.
    withheld = TRACE_CONTEXT_HEADERS if config.tracing.enabled else frozenset()
    registry = Registry(config.pools, auth, withheld)
    metrics = GatewayMetrics()
    weights = {t.name: t.weight for t in config.tenants}
    transport = Transport(
        answers=AnswerBudget(
            config.limits.max_buffered_answer_bytes,
            metrics.answer_budget_refusals.labels(),
            weights=weights,
            min_share_bytes=MAX_ANSWER_BYTES,
            share_refusals=metrics.answer_share_refusals.labels,
        ),
        streams=StreamBuffers(config.limits.max_buffered_stream_bytes),
        stored=StoredPlaces(config.upstream, weights),
    )
    gone_s = restarted_after_s_of(os.environ)  # a restarted `--processes` child's predecessor's absence
    gate = Gate(
        keyring=KeyRing(config.tenants, secret),
        limits=config.limits,
        limiters={t.name: TenantLimiter(t.quotas, now_s, restarted_after_s=gone_s) for t in config.tenants},
        models=registry.by_model,
        keying=Keying(config.pools, policy_normalizer, secret, transport),
        responses=ResponseAffinity(
            config.responses.affinity_max_entries,
            config.responses.affinity_ttl_s,
            len(config.tenants),
            ids=ResponseIds(secret),
        ),
    )
    routing = Routing(
        policy=policy,
        metrics=metrics,
        queues=build_queues(registry.pools, weights, metrics),
        access_log=AccessLog(enabled=logging.getLogger("kvgate.access").isEnabledFor(logging.INFO)),
        tracer=RequestTracer.from_config(config.tracing) if config.tracing.enabled else None,
        decision_log=(
            DecisionLog(config.decision_log.path, config.decision_log.max_records)
            if config.decision_log.path
            else None
        ),
    )
    return GatewayState(
        config=config,
        registry=registry,
        secret=secret,
        gate=gate,
        routing=routing,
        transport=transport,
        created_s=int(time.time()),
    )


class PolicySwap:
    """The policy watcher's swap callback, bound to the gateway state once it exists."""

    def __init__(self) -> None:
        self.state: GatewayState | None = None
        # Run after each swap, e.g. to give the new policy the precise-mode token hasher.
        self.after_swap: list[Callable[[GatewayState, RoutingPolicy], object]] = []

    def __call__(self, loaded: LoadedPolicy) -> None:
        if self.state is None:
            raise RuntimeError("policy reloaded before the gateway state exists")
        kept = self.state.set_policy(loaded.policy, loaded.config.normalizer)
        warn_unknown_names(self.state.config, loaded.config)
        log.info("policy swapped", extra={"policy": loaded.config.policy, "learning_kept": kept})
        for hook in self.after_swap:
            hook(self.state, loaded.policy)


def warn_unknown_names(config: GatewayConfig, policy: PolicyConfig) -> list[str]:
    """Warn of each pool and tenant the policy file tunes that the gateway config does not have:
    its settings apply to nothing (a typo, or a file written for another gateway); and of each
    section of another policy than the one it runs, which nothing reads. Returns them."""
    pools = {p.name for p in config.pools}
    tenants = {t.name for t in config.tenants}
    unknown = [f"pools.{n}" for n in policy.pools if n not in pools]
    unknown += [f"tenants.{n}" for n in policy.tenants if n not in tenants]
    for name in unknown:
        log.warning("policy file: %s is not in the gateway config; its settings apply to nothing", name)
    for section in policy.unused_sections():
        log.warning(
            "policy file: %s is not the running policy (%s); its settings apply to nothing",
            section,
            policy.policy,
        )
    return [*unknown, *policy.unused_sections()]
