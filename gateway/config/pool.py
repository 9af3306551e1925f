"""A pool in the gateway config: its workers (static, DNS or Kubernetes), timeouts, health
checks, breaker, key identity, normalizer and worker credentials. Its `pd`, `queue` and
`kubernetes` blocks have modules of their own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.base import ConfigError, Frozen, PositiveFloat, PositiveInt, read_file_or_env
from gateway.config.pd import PdConfig
from gateway.config.queue import QueueConfig
from gateway.k8s.config import KubernetesDiscoveryConfig
from gateway.upstream_headers import check_worker_key, forwardable_name
from policies.pd import HOLDER_PREFILL
from prompt_normalizer.normalizer import NormalizerConfig


class TimeoutsConfig(Frozen):
    """Per-request upstream timeouts of a pool, each finite. `read_s` is the longest silence
    allowed while waiting for the response head or between two body chunks (a non-streamed answer
    arrives only when generation ends, so it must cover a whole generation: the OpenAI SDK's own
    default of 600 s). `first_event_s` bounds a stream's wait for its first event, head included
    (the queue and the prefill, never the generation), so that a worker hung behind a live HTTP
    server is left for another well before the client's own read timeout. `total_s` bounds a
    whole request, the longest stream included."""

    connect_s: PositiveFloat = 2.0
    read_s: PositiveFloat = 600.0
    first_event_s: PositiveFloat = 120.0
    total_s: PositiveFloat = 3600.0


class HealthConfig(Frozen):
    """Active health checks: GET /health every `interval_s`."""

    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    failures_to_down: PositiveInt = 2
    successes_to_up: PositiveInt = 1


class CanaryConfig(Frozen):
    """The gateway's own small request that confirms or clears a worker's uncompared failures
    (`gateway/canary.py`): a 5xx answer, or the worker's own error event in a stream, that no
    other worker's answer compared, and which counts against no worker by itself (a client's
    input can cause it). A suspected worker of a pool without prefill/decode roles gets a
    one-token streamed `/v1/completions` of a fixed prompt, at most one at a time and one every
    `interval_s`, cut after `timeout_s`: its failure counts on the breaker, its success clears
    the suspicion, and anything else (a busy 503 or 529, a 4xx, a timeout) decides nothing."""

    enabled: bool = True
    interval_s: PositiveFloat = Field(default=2.0, le=3600)
    timeout_s: PositiveFloat = Field(default=10.0, le=600)


class BreakerConfig(Frozen):
    """Passive circuit breaker per worker: opens after `failure_threshold` consecutive request
    failures (or failed canaries in a row); half-open after `cooldown_s`, when its trial is the
    worker's canary where canaries have reached it, else one client request at a time, and
    `failure_threshold` failed client trials in a row open it again (`gateway/breaker.py`);
    `canary` confirms the failures no other worker compared."""

    failure_threshold: PositiveInt = 3
    cooldown_s: PositiveFloat = 5.0
    canary: CanaryConfig = CanaryConfig()


class IdentityConfig(Frozen):
    """What the pool's prefix keys are bound to besides model, tenant and block size: change any
    of these when the workers' model state changes (new weights, template, KV dtype), or bump
    `epoch` to forget every learned prefix of the pool at once."""

    weights_version: str = ""
    tokenizer_version: str = ""
    template_version: str = ""
    kv_dtype: str = "auto"
    epoch: int = Field(default=0, ge=0)


class DnsDiscoveryConfig(Frozen):
    """Workers as every address of a DNS name (a Kubernetes headless Service), re-resolved every
    `refresh_s`; a failed lookup keeps the last known set, an answer of no addresses (NXDOMAIN,
    no record) empties the pool once given `empty_after` times in a row over at least
    `empty_after_s` (a resolver may give one cached negative answer several times)."""

    name: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    refresh_s: PositiveFloat = 5.0
    empty_after: int = Field(2, ge=1, le=100)
    empty_after_s: float = Field(10.0, ge=0, le=3600)


class WorkersFileConfig(Frozen):
    """Workers listed in a file, re-read when it changes (`gateway.file_discovery`): a list of
    base URLs (or `{url, role}` entries), checked every `refresh_s`."""

    path: str = Field(min_length=1)
    refresh_s: PositiveFloat = Field(2.0, le=3600)


class PoolConfig(Frozen):
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
    workers_file: WorkersFileConfig | None = None
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
    # How the workers order requests by their `priority` field (docs/gateway.md, "Engine
    # priority and output budgets"). "off": they do not (vLLM's default `--scheduling-policy
    # fcfs`, which answers 400 to any priority but 0; SGLang without `--enable-priority-scheduling`),
    # and no request carries one. "lower_first": vLLM `--scheduling-policy priority`, SGLang with
    # `--schedule-low-priority-values-first`. "higher_first": SGLang's own default once priority
    # scheduling is on. Requests then carry their tenant's `engine_priority`, never the client's.
    priority_scheduling: Literal["off", "lower_first", "higher_first"] = "off"
    # The workers' context window in tokens (vLLM `--max-model-len`, SGLang `--context-length`),
    # when the operator states it; unset, each model's is learned from the workers' `/v1/models`
    # (`gateway/model_window.py`). A request's output budget counts in its worker's load for at
    # most the window (`bodies.ASSUMED_MAX_MODEL_LEN` while none is known), and one that alone
    # fills it is refused with 400, as the worker would refuse it.
    max_model_len: PositiveInt | None = None

    @field_validator("forward_headers")
    @classmethod
    def _forwardable(cls, names: list[str]) -> list[str]:
        return sorted({forwardable_name(name) for name in names})

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _endpoint_template(cls, template: str | None) -> str | None:
        if template is not None and ("{" in (rest := template.replace("{host}", "")) or "}" in rest):
            raise ValueError(f"{template!r}: `{{host}}` is the only placeholder an endpoint may have")
        return template

    @field_validator("workers", "prefill_workers", "decode_workers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if "@" in urlsplit(url).netloc:
                # Never echoed: a worker URL is a metrics label, a log field and an admin value.
                raise ValueError(
                    "a worker URL must not carry credentials (user:password@host): "
                    "give the workers' key as worker_api_key_file or worker_api_key_env"
                )
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
    def takes_roles(self) -> bool:
        """Whether the pool's workers have prefill and decode roles (a P/D pool not in
        `holder_prefill` mode, where every worker is mixed)."""
        return self.pd is not None and self.pd.mode != HOLDER_PREFILL

    @property
    def base_model(self) -> str:
        """The model the pool's LoRA adapters run on: its first model id that is not an adapter."""
        return next((m for m in self.models if m not in self.adapters), self.models[0])

    @property
    def subscribes_kv_events(self) -> bool:
        """Whether the pool's workers publish KV events (an endpoint template, or per pod)."""
        k8s = self.kubernetes
        return self.kv_events_endpoint is not None or (k8s is not None and k8s.finds_kv_events)

    @model_validator(mode="after")
    def _one_source(self) -> PoolConfig:
        sources = [
            bool(self.static_urls),
            self.dns is not None,
            self.kubernetes is not None,
            self.workers_file is not None,
        ]
        if sum(sources) != 1:
            raise ValueError(
                "a pool needs exactly one of 'workers' (static URLs), 'dns' (a DNS name), "
                "'kubernetes' (pods by label selector) or 'workers_file' (a file listing them); "
                "'prefill_workers' and 'decode_workers' are static URLs too"
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
            # Named by position: a URL may carry credentials.
            i = next(i for i, u in enumerate(urls) if u in urls[:i])
            raise ValueError(
                "a worker URL is listed twice (workers, prefill_workers, decode_workers): "
                f"URL {i + 1} of the {len(urls)} in that order repeats URL {urls.index(urls[i]) + 1}"
            )
        if (self.prefill_workers or self.decode_workers) and self.pd is None:
            raise ValueError("prefill_workers and decode_workers need a 'pd' section (the wire protocol)")
        # In holder_prefill mode every worker is mixed, so discovery need not know roles, and a
        # prefill or decode worker would take no part (a prefill one never runs a request, a
        # decode one never holds a prompt the chooser can use).
        holder = self.pd is not None and self.pd.mode == HOLDER_PREFILL
        if holder and (self.prefill_workers or self.decode_workers):
            raise ValueError("pd.mode holder_prefill takes mixed workers only: list them under 'workers'")
        if holder and self.kubernetes is not None and self.kubernetes.role_label is not None:
            raise ValueError("pd.mode holder_prefill takes mixed workers only: drop kubernetes.role_label")
        needs_roles = self.pd is not None and not holder
        if needs_roles and self.dns is not None:
            raise ValueError(
                "pd: DNS discovery knows no roles; list prefill_workers and decode_workers, list the "
                "workers with their roles in a workers_file, or set pd.mode: holder_prefill (every "
                "worker mixed)"
            )
        k8s = self.kubernetes
        if needs_roles and k8s is not None and k8s.role_label is None:
            raise ValueError("pd: Kubernetes discovery needs kubernetes.role_label to find each pod's role")


def read_worker_key(pool: PoolConfig, environ: Mapping[str, str]) -> str | None:
    """The pool's worker API key (None when it has none): from its file (trailing whitespace
    ignored) or its environment variable. Errors name the field and the source, never the key."""
    field = f"pools.{pool.name}.worker_api_key"
    value = read_file_or_env(field, pool.worker_api_key_file, pool.worker_api_key_env, environ)
    if value is None:
        return None
    try:
        return check_worker_key(value)
    except ValueError as exc:
        kind, source = (
            ("file", pool.worker_api_key_file)
            if pool.worker_api_key_file
            else ("env", pool.worker_api_key_env)
        )
        raise ConfigError(f"{field}_{kind}: {exc} (in {source})") from None
