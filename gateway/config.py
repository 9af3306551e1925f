"""The gateway's YAML configuration, parsed at the edge into frozen pydantic models.

Secrets never live in this file: API keys appear only as keyed hashes, and the key-hash secret is
read from an environment variable or a file named here. Validation errors name the offending field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.k8s.config import KubernetesDiscoveryConfig
from gateway.otel_sdk import tracing_unavailable
from gateway.upstream_headers import check_worker_key, forwardable_name
from policies.base import Isolation
from prompt_normalizer.normalizer import NormalizerConfig

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Frozen):
    """Where the gateway accepts clients."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)


class LimitsConfig(_Frozen):
    """Bounds on what clients control, applied before a request is authenticated and admitted
    (see gateway/http_limits.py), and the completions in flight across tenants.

    Per connection: the request line and headers (`max_header_bytes`, `max_headers`; beyond: 431
    and close), the time to send them (`header_timeout_s`, from the connection's opening or its
    first byte after idling) and then the body (`body_timeout_s`; either: 408 and close), idle
    time between requests (`keepalive_timeout_s`), and open connections per process
    (`max_client_connections`; beyond: closed at once). Per request: the body size (413).
    Completions past their tenant's own slot and their body, across tenants
    (`max_in_flight_requests`; beyond: 503 with Retry-After, so every per-request structure
    stays bounded).
    """

    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    max_in_flight_requests: PositiveInt = 4096
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    max_headers: PositiveInt = 100
    header_timeout_s: PositiveFloat = 10.0
    body_timeout_s: PositiveFloat = 30.0
    keepalive_timeout_s: PositiveFloat = 30.0
    max_client_connections: PositiveInt = 4096


class MetricsConfig(_Frozen):
    """Where Prometheus scrapes `GET /metrics`: a listener of its own, never the client port
    (the metrics name tenants and worker URLs). Loopback by default; in a pod, the pod's address
    (`0.0.0.0`) so that Prometheus can reach it. Port 0 picks a free port (printed at startup)."""

    listen: ListenConfig = ListenConfig(port=9464)


class DrainConfig(_Frozen):
    """Graceful shutdown: readiness flips to 503 at once, listening stops after `shutdown_delay_s`,
    in-flight streams get until `deadline_s` (counted from the signal) before a terminal error event."""

    shutdown_delay_s: float = Field(default=0.0, ge=0)
    deadline_s: PositiveFloat = 30.0


class UpstreamConfig(_Frozen):
    """The one shared upstream HTTP client of the process."""

    max_connections: PositiveInt = 1024
    max_connections_per_worker: PositiveInt = 256
    keepalive_timeout_s: PositiveFloat = 30.0


class TimeoutsConfig(_Frozen):
    """Per-request upstream timeouts of a pool. `read_s` is the longest silence allowed while
    waiting for the response head or between two body chunks (a non-streamed answer arrives only
    when generation ends, so it must cover a whole generation)."""

    connect_s: PositiveFloat = 2.0
    read_s: PositiveFloat = 120.0
    total_s: PositiveFloat = 600.0


class HealthConfig(_Frozen):
    """Active health checks: GET /health every `interval_s`."""

    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    failures_to_down: PositiveInt = 2
    successes_to_up: PositiveInt = 1


class BreakerConfig(_Frozen):
    """Passive circuit breaker per worker: opens after `failure_threshold` consecutive request
    failures, lets one trial request through after `cooldown_s`."""

    failure_threshold: PositiveInt = 3
    cooldown_s: PositiveFloat = 5.0


class IdentityConfig(_Frozen):
    """What the pool's prefix keys are bound to besides model, tenant and block size: change any
    of these when the workers' model state changes (new weights, template, KV dtype), or bump
    `epoch` to forget every learned prefix of the pool at once."""

    weights_version: str = ""
    tokenizer_version: str = ""
    template_version: str = ""
    kv_dtype: str = "auto"
    epoch: int = Field(default=0, ge=0)


class DnsDiscoveryConfig(_Frozen):
    """Workers as every address of a DNS name (a Kubernetes headless Service), re-resolved every
    `refresh_s`; a failed lookup keeps the last known set."""

    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    refresh_s: PositiveFloat = 5.0


class PdTransferConfig(_Frozen):
    """How long moving a request's KV from its prefill worker to its decode worker takes:
    `setup_s + tokens × bytes_per_token / bandwidth_bytes_per_s` (defaults: Llama-3-8B in bf16,
    one 400 Gb/s RDMA link)."""

    setup_s: float = Field(default=0.001, ge=0)
    bytes_per_token: PositiveInt = 131_072
    bandwidth_bytes_per_s: PositiveFloat = 45e9


class PdConfig(_Frozen):
    """Prefill/decode disaggregation of a pool (docs/pd.md): the wire protocol the workers speak,
    the transfer model that prices a split, and whether a request may skip the split."""

    protocol: Literal["vllm", "sglang"] = "vllm"
    transfer: PdTransferConfig = PdTransferConfig()
    # SGLang: the prefill workers' bootstrap port (`--disaggregation-bootstrap-port`), and the
    # port of any prefill worker (by URL) that uses another one.
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=dict)
    # Conditional disaggregation: a request may run on one worker alone when that scores better.
    conditional: bool = True
    # Weight of the delay a prefill run on a decode worker imposes on the requests it is decoding.
    interference_weight: float = Field(default=1.0, ge=0)

    @field_validator("bootstrap_ports")
    @classmethod
    def _port_urls(cls, ports: dict[str, int]) -> dict[str, int]:
        for url in ports:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        return {u.rstrip("/"): port for u, port in ports.items()}

    def bootstrap_port_of(self, url: str) -> int | None:
        """The bootstrap port of the prefill worker at `url` (SGLang)."""
        return self.bootstrap_ports.get(url, self.bootstrap_port)


class QueueConfig(_Frozen):
    """The pool's waiting room (gateway/queueing.py): a request that finds every routable worker
    at `max_in_flight_per_worker` waits here for a free slot instead of failing. Tenants share
    the freed slots by their `weight`; within a tenant, vLLM's `priority` (lower first) goes first.
    Beyond `max_per_tenant` waiting requests of one tenant: 429; beyond `max_requests` in the
    pool: 503; waiting longer than `timeout_s`: 503 (all with `Retry-After`). `order: fifo` serves
    arrivals in order whatever the tenant (for comparison; one tenant's flood then delays all)."""

    enabled: bool = True
    max_requests: PositiveInt = 1024
    max_per_tenant: PositiveInt = 256
    timeout_s: PositiveFloat = 30.0
    order: Literal["fair", "fifo"] = "fair"


class PoolConfig(_Frozen):
    """A set of interchangeable workers serving the same model(s)."""

    name: str = Field(min_length=1)
    models: list[str] = Field(min_length=1)
    workers: list[str] = Field(default_factory=list)
    # Static workers with a prefill/decode role (`workers` are mixed); see `pd`.
    prefill_workers: list[str] = Field(default_factory=list)
    decode_workers: list[str] = Field(default_factory=list)
    pd: PdConfig | None = None
    dns: DnsDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None
    # KV-cache events (vLLM `--kv-events-config`): `{host}` is replaced by each worker's address.
    # Precise routing needs token-exact keys: the pool's normalizer in `tokenizer` or `render` mode.
    kv_events_endpoint: str | None = Field(default=None, min_length=1)
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    max_in_flight_per_worker: PositiveInt | None = 256
    retry_attempts: int = Field(default=2, ge=0, le=5)
    queue: QueueConfig = QueueConfig()
    block_size_tokens: PositiveInt = 16
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    breaker: BreakerConfig = BreakerConfig()
    # None: use the policy file's `normalizer` section (hot-reloaded with it).
    normalizer: NormalizerConfig | None = None
    identity: IdentityConfig = IdentityConfig()
    # Served model id -> LoRA adapter name (vLLM serves each adapter under its own model id); the
    # adapter is bound into that model's prefix keys and matches KV events' `lora_name`.
    adapters: dict[str, str] = Field(default_factory=dict)
    # The workers' API key (vLLM `--api-key`), from an environment variable or a file (a mounted
    # Secret), sent as `Authorization: Bearer` on every request to them (gateway/upstream_headers.py).
    worker_api_key_env: str | None = Field(default=None, min_length=1)
    worker_api_key_file: str | None = Field(default=None, min_length=1)
    # Client headers passed on to the workers; never hop-by-hop headers or credentials.
    forward_headers: list[str] = Field(default_factory=list, max_length=32)

    @field_validator("forward_headers")
    @classmethod
    def _forwardable(cls, names: list[str]) -> list[str]:
        return sorted({forwardable_name(name) for name in names})

    @field_validator("workers", "prefill_workers", "decode_workers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        return [u.rstrip("/") for u in urls]

    @property
    def static_urls(self) -> list[str]:
        """Every static worker URL, whatever its role."""
        return [*self.workers, *self.prefill_workers, *self.decode_workers]

    @property
    def static_roles(self) -> dict[str, str]:
        """The role of each static worker listed under `prefill_workers` or `decode_workers`."""
        roles = dict.fromkeys(self.prefill_workers, "prefill")
        roles.update(dict.fromkeys(self.decode_workers, "decode"))
        return roles

    @property
    def subscribes_kv_events(self) -> bool:
        """Whether the pool's workers publish KV events (an endpoint template, or per pod)."""
        k8s = self.kubernetes
        return self.kv_events_endpoint is not None or (k8s is not None and k8s.finds_kv_events)

    @model_validator(mode="after")
    def _one_source(self) -> PoolConfig:
        sources = [bool(self.static_urls), self.dns is not None, self.kubernetes is not None]
        if sum(sources) != 1:
            raise ValueError(
                "a pool needs exactly one of 'workers' (static URLs) or 'dns' (a DNS name) or "
                "'kubernetes' (pods by label selector); 'prefill_workers' and 'decode_workers' are "
                "static URLs too"
            )
        self._check_roles()
        k8s = self.kubernetes
        if k8s is not None and k8s.finds_kv_events and self.kv_events_endpoint is not None:
            raise ValueError(
                "kv_events_endpoint and kubernetes.kv_events_port / kv_events_annotation both say "
                "where KV events come from: keep one"
            )
        unknown = sorted(set(self.adapters) - set(self.models))
        if unknown:
            raise ValueError(f"adapters: {unknown[0]!r} is not one of the pool's models")
        if any(not name for name in self.adapters.values()):
            raise ValueError("adapters: an adapter name must not be empty")
        if self.worker_api_key_env is not None and self.worker_api_key_file is not None:
            raise ValueError("set worker_api_key_env or worker_api_key_file, not both")
        return self

    def _check_roles(self) -> None:
        urls = self.static_urls
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL is listed twice (workers, prefill_workers, decode_workers)")
        if (self.prefill_workers or self.decode_workers) and self.pd is None:
            raise ValueError("prefill_workers and decode_workers need a 'pd' section (the wire protocol)")
        if self.pd is not None and self.dns is not None:
            raise ValueError("pd: DNS discovery knows no roles; list prefill_workers and decode_workers")
        k8s = self.kubernetes
        if self.pd is not None and k8s is not None and k8s.role_label is None:
            raise ValueError("pd: Kubernetes discovery needs kubernetes.role_label to find each pod's role")


class QuotaConfig(_Frozen):
    """Per-tenant limits. None means unlimited. rpm and tpm are token buckets with a one-minute
    capacity (a burst of a full minute's budget is allowed)."""

    max_concurrent: PositiveInt | None = None
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None


class TenantConfig(_Frozen):
    """A customer namespace: its API keys (as hashes), isolation level and quotas."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    api_key_hashes: list[str] = Field(min_length=1)
    isolation: Isolation = Isolation.STRICT
    quotas: QuotaConfig = QuotaConfig()
    # The tenant's share of a full pool's freed worker slots, relative to the other tenants waiting.
    weight: float = Field(default=1.0, ge=0.01, le=100.0)

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, hashes: list[str]) -> list[str]:
        for h in hashes:
            if not h.startswith("hmac-sha256:") or len(h) != len("hmac-sha256:") + 64:
                raise ValueError(
                    "each entry must be 'hmac-sha256:<64 hex>' (make one with `kvgate serve --hash-key`)"
                )
        return hashes


class ScrapeSettings(_Frozen):
    """Polling each worker's Prometheus /metrics (queue depth, KV usage, cache size) for routing.
    A result older than `max_age_s` is ignored."""

    enabled: bool = True
    interval_s: PositiveFloat = 1.0
    timeout_s: PositiveFloat = 0.5
    max_age_s: PositiveFloat = 5.0


class TracingConfig(_Frozen):
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


class SecretsConfig(_Frozen):
    """Where the key-hash secret comes from: an environment variable or a file (never this YAML)."""

    key_hash_secret_env: str | None = "KVGATE_KEY_SECRET"
    key_hash_secret_file: str | None = None


class AdminConfig(_Frozen):
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


class ResponsesConfig(_Frozen):
    """Responses API state (`gateway/responses_affinity.py`): the gateway remembers which worker
    holds each stored response, for at most `affinity_max_entries` ids (least recently used
    forgotten first), each for `affinity_ttl_s` after its last use. A forgotten id is routed like
    any request; only the worker holding it can answer it."""

    affinity_max_entries: PositiveInt = 100_000
    affinity_ttl_s: PositiveFloat = 86_400.0


class DecisionLogConfig(_Frozen):
    """The decision log (`gateway/decision_log.py`), off unless `path` is set: one JSON line per
    routed request with the policy's view of the top candidates and the worker's reported cached
    tokens, at most `max_records` lines per process. For comparing routing with the simulator
    (`kvgate bench replay`), not for production traffic."""

    path: str | None = None
    max_records: PositiveInt = 100_000


class SyncConfig(_Frozen):
    """Replica sync (docs/sync.md): gateways sharing one worker fleet publish their routing decisions
    and in-flight load through a NATS broker and apply each other's. Off unless `url` is set.

    The broker is never on a request's path: items wait in a queue of `queue_max_items` (the
    oldest is dropped and counted when it is full) and go out in batches of up to
    `batch_max_items`, `batch_interval_s` after the first of them. Every `load_refresh_s` the
    whole in-flight load goes out even if unchanged; a peer silent for `peer_timeout_s` is
    forgotten with its load."""

    url: str | None = Field(default=None, pattern=r"^(nats|tls)://")
    subject_prefix: str = Field(default="kvgate.sync", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
    batch_max_items: PositiveInt = 256
    batch_interval_s: PositiveFloat = 0.005
    queue_max_items: PositiveInt = 16_384
    load_refresh_s: PositiveFloat = 1.0
    peer_timeout_s: PositiveFloat = 5.0
    connect_timeout_s: PositiveFloat = 2.0

    @model_validator(mode="after")
    def _timeouts(self) -> SyncConfig:
        if self.peer_timeout_s <= self.load_refresh_s:
            raise ValueError("peer_timeout_s must be longer than load_refresh_s")
        return self


class GatewayConfig(_Frozen):
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
    policy_file: str | None = None
    policy_reload_interval_s: PositiveFloat = 2.0
    pools: list[PoolConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(min_length=1)
    log_level: str = "info"

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
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError("pool names must be unique")
        tenants = [t.name for t in self.tenants]
        if len(set(tenants)) != len(tenants):
            raise ValueError("tenant names must be unique")
        hashes = [h for t in self.tenants for h in t.api_key_hashes]
        if len(set(hashes)) != len(hashes):
            raise ValueError("an API key hash is listed twice")
        if self.admin.api_key_hash is not None and self.admin.api_key_hash in hashes:
            raise ValueError("admin.api_key_hash must not also be a tenant's key")
        if self.metrics.listen.port != 0 and self.metrics.listen.port == self.listen.port:
            raise ValueError("metrics.listen.port must differ from listen.port (metrics never share it)")
        return self


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


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a config file. A relative `policy_file` is resolved against the file's folder."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping")
    config = parse_config(raw)
    if config.policy_file is not None and not Path(config.policy_file).is_absolute():
        config = config.model_copy(update={"policy_file": str(p.parent / config.policy_file)})
    pools = [
        pool.model_copy(update={"worker_api_key_file": str(p.parent / pool.worker_api_key_file)})
        if pool.worker_api_key_file is not None and not Path(pool.worker_api_key_file).is_absolute()
        else pool
        for pool in config.pools
    ]
    config = config.model_copy(update={"pools": pools})
    if (
        config.secrets.key_hash_secret_file is not None
        and not Path(config.secrets.key_hash_secret_file).is_absolute()
    ):
        secrets = config.secrets.model_copy(
            update={"key_hash_secret_file": str(p.parent / config.secrets.key_hash_secret_file)}
        )
        config = config.model_copy(update={"secrets": secrets})
    return config


def read_secret(secrets: SecretsConfig, environ: dict[str, str]) -> bytes:
    """The key-hash secret: the file wins over the environment variable; empty is an error."""
    if secrets.key_hash_secret_file is not None:
        try:
            value = Path(secrets.key_hash_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"secrets.key_hash_secret_file: cannot read {secrets.key_hash_secret_file!r}: {exc.strerror}"
            ) from None
        if not value:
            raise ConfigError("secrets.key_hash_secret_file: the file is empty")
        return value
    if secrets.key_hash_secret_env is not None:
        env_value = environ.get(secrets.key_hash_secret_env, "")
        if not env_value:
            raise ConfigError(
                f"secrets.key_hash_secret_env: environment variable {secrets.key_hash_secret_env} is not set"
            )
        return env_value.encode()
    raise ConfigError("secrets: set key_hash_secret_env or key_hash_secret_file")


def read_worker_key(pool: PoolConfig, environ: Mapping[str, str]) -> str | None:
    """The pool's worker API key (None when it has none): from its file (trailing whitespace
    ignored) or its environment variable. Errors name the field and the source, never the key."""
    if pool.worker_api_key_file is not None:
        field_name, source = f"pools.{pool.name}.worker_api_key_file", pool.worker_api_key_file
        try:
            value = Path(source).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise ConfigError(f"{field_name}: cannot read {source!r}: {reason}") from None
    elif pool.worker_api_key_env is not None:
        field_name, source = f"pools.{pool.name}.worker_api_key_env", pool.worker_api_key_env
        value = environ.get(source, "")
        if not value:
            raise ConfigError(f"{field_name}: environment variable {source} is not set")
    else:
        return None
    try:
        return check_worker_key(value)
    except ValueError as exc:
        raise ConfigError(f"{field_name}: {exc} (in {source})") from None
