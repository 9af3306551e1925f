"""The gateway's YAML configuration, parsed at the edge into frozen pydantic models: the file's
top level, the process-wide blocks and the tenants here; a pool in `pool`, its `pd` and `queue`
blocks in modules of their own (and its `kubernetes` block in `gateway.k8s.config`), replica sync
in `sync`, browser origins in `cors`, and what every block shares (`ConfigError`, `Frozen`) in `base`.

Secrets never live in this file: API keys appear only as keyed hashes, and the key-hash secret is
read from an environment variable or a file named here. Validation errors name the offending field.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gateway.config.base import ConfigError, Frozen, PositiveFloat, PositiveInt
from gateway.config.cors import CorsConfig
from gateway.config.paths import relative_to
from gateway.config.pool import PoolConfig
from gateway.config.sync import SyncConfig
from gateway.logs import LOG_LEVELS
from gateway.otel_sdk import tracing_unavailable
from policies.base import Isolation
from policies.operator_yaml import OperatorYamlError, load_operator_yaml


class ListenConfig(Frozen):
    """Where the gateway accepts clients."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)


class LimitsConfig(Frozen):
    """Bounds on what clients control, applied before a request is authenticated and admitted
    (see gateway/http_limits.py), and the completions in flight across tenants.

    Per connection: the request line and headers (`max_header_bytes`, `max_headers`; beyond: 431
    and close), the time to send them (`header_timeout_s`, from the connection's opening or its
    first byte after idling) and then the body (`body_timeout_s`; either: 408 and close), idle
    time between requests (`keepalive_timeout_s`), the time a response may wait on a client that
    reads nothing (`send_timeout_s`; then the connection is aborted and the request cancelled),
    and open connections per process (`max_client_connections`). A new connection past it takes
    the place of one holding its place without a request in the app (idle, still sending its
    head or the body of a request already answered, or lingering after its last answer), which
    is closed: from the client address holding the most such connections, the one holding its
    place longest there. So connections opened and left silent, or sending their heads byte by
    byte, displace their own address's connections, not other clients'. With none so held, the
    connection stalled longest on a client that reads nothing is aborted for the new one (as
    `send_timeout_s` would abort it). Only when every place has a request in the app whose
    client reads is the new connection closed at once. And per client address
    (`max_client_connections_per_address`, 0: no limit; off by default because behind an
    ingress or a proxy every client shares its address, and eviction already keeps one address
    from locking the others out). Per
    request: the body size (413), and the sequences a request runs (`max_choices`; beyond: 400):
    the choices a chat, completions or native generate request asks for (`n`, `best_of` on
    completions, `sampling_params.n`), times the prompts of a batch (a completions or generate
    batch's prompts, a chat batch's conversations), and the items or questions of vLLM's reads
    (`/generative_scoring`, `/v1/systemone`, `/v1/decisions`), each prefilled as a prompt of its
    own. The inputs of a pooling request (`max_pooling_inputs`; beyond: 400): the inputs of an
    embeddings, pooling, classify or SGLang `/encode` request, the documents of a rerank, the
    pairs of a score, each encoded on its own.
    Completions past their tenant's own slot and their body, across tenants
    (`max_in_flight_requests`; at it, only a tenant below its share of it gets a place, up to
    twice it in all: `lifecycle.RequestCap`; any other request: 503 with Retry-After, so every
    per-request structure stays bounded). Bytes of workers' whole answers held at once, across
    requests, each from its first byte read until it has been written to its client
    (`max_buffered_answer_bytes`; the answer that would pass it: 503 with Retry-After). Unread
    bytes of streamed answers across requests (`max_buffered_stream_bytes`; past it every
    stream stops reading from its worker sooner, nothing is refused).
    """

    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    # OpenAI's chat completions take `n` up to 128.
    max_choices: PositiveInt = 128
    # OpenAI's embeddings API takes at most 2,048 inputs in one request.
    max_pooling_inputs: PositiveInt = 2048
    max_in_flight_requests: PositiveInt = 4096
    # Eight answers at the per-answer cap (`upstream_conn.MAX_ANSWER_BYTES`, 64 MiB).
    max_buffered_answer_bytes: int = Field(default=512 * 1024 * 1024, ge=1024 * 1024)
    max_buffered_stream_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_headers: PositiveInt = 100
    header_timeout_s: PositiveFloat = 10.0
    body_timeout_s: PositiveFloat = 30.0
    keepalive_timeout_s: PositiveFloat = 30.0
    # nginx's `send_timeout` default: a client that reads nothing for a minute is taken as gone.
    send_timeout_s: PositiveFloat = 60.0
    max_client_connections: PositiveInt = 4096
    # Off by default: behind an ingress or a proxy every client shares the proxy's address. A
    # full table takes the place of the address holding the most idle or half-sent connections.
    max_client_connections_per_address: int = Field(default=0, ge=0)


class MetricsConfig(Frozen):
    """Where Prometheus scrapes `GET /metrics`: a listener of its own, never the client port
    (the metrics name tenants and worker URLs). Loopback by default; in a pod, the pod's address
    (`0.0.0.0`) so that Prometheus can reach it. Port 0 picks a free port (printed at startup)."""

    listen: ListenConfig = ListenConfig(port=9464)


# How long after its drain deadline a gateway process may take to exit: the server's last-resort
# timeout (gateway/server.py), closing connections, the last log lines and spans. Supervisors
# (`kvgate serve --processes`, Kubernetes' grace period) allow at least `deadline_s` plus this.
EXIT_MARGIN_S = 10.0


class DrainConfig(Frozen):
    """Graceful shutdown: readiness flips to 503 at once, listening stops after `shutdown_delay_s`,
    and what is in flight gets until `deadline_s` (counted from the signal); then the gateway ends
    the rest itself with `gateway_shutting_down`: a stream with a terminal error event, a request
    still queued or waiting on a worker with a 503. The process exits within `EXIT_MARGIN_S` after."""

    shutdown_delay_s: float = Field(default=0.0, ge=0)
    deadline_s: PositiveFloat = 30.0


class UpstreamConfig(Frozen):
    """The one shared upstream HTTP client of the process."""

    max_connections: PositiveInt = 1024
    max_connections_per_worker: PositiveInt = 256
    keepalive_timeout_s: PositiveFloat = 30.0


class QuotaConfig(Frozen):
    """Per-tenant limits. None means unlimited. rpm and tpm are token buckets with a one-minute
    capacity (a burst of a full minute's budget is allowed)."""

    max_concurrent: PositiveInt | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None


# The widest engine priority the config takes, either way: far from any int limit of the engines
# (vLLM and SGLang read Python ints; SGLang gives a request without one `sys.maxsize`).
MAX_ENGINE_PRIORITY = 1_000_000


class EnginePriorityConfig(Frozen):
    """Where a tenant's requests stand at engines that order requests by `priority` (a pool's
    `priority_scheduling`), lower first as in vLLM and the gateway's own queue: at `base`, moved
    by the client's own `priority` clamped to `[client_min, client_max]`. Engines order every
    tenant's requests in one queue, so the operator places tenants there, never their clients: by
    default every tenant is at 0 and no client moves (its `priority` orders only its own requests
    in the gateway's queue). A band above 0 lets a client send its own requests back, never ahead
    of other tenants at the same `base`."""

    base: int = Field(default=0, ge=-MAX_ENGINE_PRIORITY, le=MAX_ENGINE_PRIORITY)
    client_min: int = Field(default=0, ge=-MAX_ENGINE_PRIORITY, le=MAX_ENGINE_PRIORITY)
    client_max: int = Field(default=0, ge=-MAX_ENGINE_PRIORITY, le=MAX_ENGINE_PRIORITY)

    @model_validator(mode="after")
    def _band(self) -> EnginePriorityConfig:
        if self.client_min > self.client_max:
            raise ValueError(f"client_min ({self.client_min}) is above client_max ({self.client_max})")
        return self

    def value(self, client_priority: int) -> int:
        """The priority (lower first) a request whose client asked for `client_priority` gets."""
        return self.base + min(max(client_priority, self.client_min), self.client_max)


class TenantConfig(Frozen):
    """A customer namespace: its API keys (as hashes), isolation level, quotas, its share of a
    full pool's freed slots and its place at engines that schedule by priority."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    api_key_hashes: list[str] = Field(min_length=1)
    isolation: Isolation = Isolation.STRICT
    quotas: QuotaConfig = QuotaConfig()
    # The tenant's share of a full pool's freed worker slots, relative to the other tenants waiting.
    weight: float = Field(default=1.0, ge=0.01, le=100.0)
    engine_priority: EnginePriorityConfig = EnginePriorityConfig()

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, hashes: list[str]) -> list[str]:
        for h in hashes:
            if not h.startswith("hmac-sha256:") or len(h) != len("hmac-sha256:") + 64:
                raise ValueError(
                    "each entry must be 'hmac-sha256:<64 hex>' (make one with `kvgate serve --hash-key`)"
                )
        return hashes


class ScrapeSettings(Frozen):
    """Polling each worker's Prometheus /metrics (queue depth, KV usage, cache size) for routing.
    A result older than `max_age_s` is ignored."""

    enabled: bool = True
    interval_s: PositiveFloat = 1.0
    timeout_s: PositiveFloat = 0.5
    max_age_s: PositiveFloat = 5.0


class TracingConfig(Frozen):
    """OpenTelemetry traces: a SERVER span per completion request and a CLIENT span per attempt on
    a worker, exported by the SDK the process sets up from the standard `OTEL_*` variables
    (`gateway/otel_sdk.py`; needs `pip install 'kvgate[otel]'`, checked when the config loads)."""

    enabled: bool = False
    # `gen_ai.provider.name` of the spans: the API the workers speak (vLLM and SGLang speak OpenAI's).
    provider_name: str = Field(default="openai", min_length=1)

    @model_validator(mode="after")
    def _sdk_present(self) -> TracingConfig:
        if self.enabled and (problem := tracing_unavailable(os.environ)):
            raise ValueError(problem)
        return self


class SecretsConfig(Frozen):
    """Where the key-hash secret comes from: an environment variable or a file (never this YAML)."""

    key_hash_secret_env: str | None = "KVGATE_KEY_SECRET"
    key_hash_secret_file: str | None = None


class AdminConfig(Frozen):
    """The admin API (`/admin/status`, `/admin/policy/reload`): off unless a key hash is set."""

    api_key_hash: str | None = None

    @field_validator("api_key_hash")
    @classmethod
    def _hash(cls, value: str | None) -> str | None:
        if value is not None and (
            not value.startswith("hmac-sha256:") or len(value) != len("hmac-sha256:") + 64
        ):
            raise ValueError("must be 'hmac-sha256:<64 hex>' (make one with `kvgate serve --hash-key`)")
        return value


class ResponsesConfig(Frozen):
    """Responses API state (`gateway/responses_affinity.py`): the gateway remembers which worker
    holds each stored response, for at most `affinity_max_entries` ids, each for `affinity_ttl_s`
    after its last use. Each tenant is reserved an equal share (`affinity_max_entries` divided by
    the number of tenants) that no other tenant's ids can evict; when the map is full, ids of a
    tenant above its share are forgotten first, least recently used first. A forgotten id is
    routed like any request; only the worker holding it can answer it."""

    affinity_max_entries: PositiveInt = 100_000
    affinity_ttl_s: PositiveFloat = 86_400.0


class DecisionLogConfig(Frozen):
    """The decision log (`gateway/decision_log.py`), off unless `path` is set: one JSON line per
    routed request with the policy's view of the top candidates and the worker's reported cached
    tokens, at most `max_records` lines per process. For comparing routing with the simulator
    (`kvgate bench replay`), not for production traffic."""

    path: str | None = None
    max_records: PositiveInt = 100_000


class GatewayConfig(Frozen):
    """Top level of the gateway config file."""

    listen: ListenConfig = ListenConfig()
    limits: LimitsConfig = LimitsConfig()
    drain: DrainConfig = DrainConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    scrape: ScrapeSettings = ScrapeSettings()
    tracing: TracingConfig = TracingConfig()
    secrets: SecretsConfig = SecretsConfig()
    admin: AdminConfig = AdminConfig()
    metrics: MetricsConfig = MetricsConfig()
    responses: ResponsesConfig = ResponsesConfig()
    sync: SyncConfig = SyncConfig()
    decision_log: DecisionLogConfig = DecisionLogConfig()
    cors: CorsConfig = CorsConfig()
    policy_file: str | None = None
    policy_reload_interval_s: PositiveFloat = 2.0
    pools: list[PoolConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(min_length=1)
    log_level: str = Field(default="info", json_schema_extra={"pattern": f"(?i)^({'|'.join(LOG_LEVELS)})$"})

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)} (any case), not {value!r}")
        return value.lower()

    @model_validator(mode="after")
    def _unique(self) -> GatewayConfig:
        seen_models: dict[str, str] = {}
        for pool in self.pools:
            for model in pool.models:
                if model in seen_models:
                    raise ValueError(
                        f"model {model!r} is served by pools {seen_models[model]!r} and {pool.name!r}"
                    )
                seen_models[model] = pool.name
        if (twice := _twice(p.name for p in self.pools)) is not None:
            raise ValueError(f"pool names must be unique: {twice!r} names two pools")
        if (twice := _twice(t.name for t in self.tenants)) is not None:
            raise ValueError(f"tenant names must be unique: {twice!r} names two tenants")
        owner: dict[str, str] = {}
        for t in self.tenants:
            for h in t.api_key_hashes:
                if h in owner:
                    # Named by its owners, never by the hash.
                    by = (
                        f"tenant {t.name!r}" if owner[h] == t.name else f"tenants {owner[h]!r} and {t.name!r}"
                    )
                    raise ValueError(f"an API key hash is listed twice, by {by}")
                owner[h] = t.name
        hashes = list(owner)
        if self.admin.api_key_hash is not None and self.admin.api_key_hash in hashes:
            raise ValueError("admin.api_key_hash must not also be a tenant's key")
        if self.metrics.listen.port != 0 and self.metrics.listen.port == self.listen.port:
            raise ValueError(
                f"metrics.listen.port must differ from listen.port (both {self.listen.port}; "
                "metrics never share the client port)"
            )
        return self


def _twice(names: Iterable[str]) -> str | None:
    """The first name that comes a second time, if any."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
    )


def parse_config(raw: Any) -> GatewayConfig:
    """Validate an already-loaded mapping; raises `ConfigError` naming each bad field."""
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid gateway config: {_describe(exc)}") from None


def revalidated(config: GatewayConfig, **update: Any) -> GatewayConfig:
    """`config` with top-level fields replaced (each a model or its mapping) and the whole checked
    again: `model_copy(update=...)` checks nothing, so a command-line override could otherwise make
    a config that no file may hold, such as a metrics port equal to the client port."""
    try:
        return GatewayConfig.model_validate({**dict(config), **update})
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a config file. A relative `policy_file` is resolved against the file's folder."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from None
    try:
        raw = load_operator_yaml(text) or {}
    except OperatorYamlError as exc:
        raise ConfigError(f"config file {str(p)!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping")
    config = parse_config(raw)
    return relative_to(config, p.parent)


# The key-hash secret is the HMAC key of every API-key hash in the config: with a short one, a
# leaked hash can be tested against guessed secrets and keys offline. The Helm chart asks as much.
MIN_KEY_HASH_SECRET_BYTES = 32
_SHORT_SECRET = (
    f"shorter than {MIN_KEY_HASH_SECRET_BYTES} bytes: the key-hash secret keys every API-key hash, "
    "and a short one can be guessed (make one with: openssl rand -hex 32)"
)


def read_secret(secrets: SecretsConfig, environ: dict[str, str]) -> bytes:
    """The key-hash secret: the file wins over the environment variable; empty, or shorter than
    `MIN_KEY_HASH_SECRET_BYTES`, is an error (naming the source, never the value)."""
    if secrets.key_hash_secret_file is not None:
        try:
            value = Path(secrets.key_hash_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"secrets.key_hash_secret_file: cannot read {secrets.key_hash_secret_file!r}: {exc.strerror}"
            ) from None
        if not value:
            raise ConfigError("secrets.key_hash_secret_file: the file is empty")
        if len(value) < MIN_KEY_HASH_SECRET_BYTES:
            raise ConfigError(
                f"secrets.key_hash_secret_file: {secrets.key_hash_secret_file!r} is {_SHORT_SECRET}"
            )
        return value
    if secrets.key_hash_secret_env is not None:
        env_value = environ.get(secrets.key_hash_secret_env, "").encode()
        if not env_value:
            raise ConfigError(
                f"secrets.key_hash_secret_env: environment variable {secrets.key_hash_secret_env} is not set"
            )
        if len(env_value) < MIN_KEY_HASH_SECRET_BYTES:
            raise ConfigError(
                f"secrets.key_hash_secret_env: environment variable {secrets.key_hash_secret_env} is "
                f"{_SHORT_SECRET}"
            )
        return env_value
    raise ConfigError("secrets: set key_hash_secret_env or key_hash_secret_file")
