"""Prometheus text for /metrics with vLLM's metric names (V1 names plus the older aliases that
production-stack and other routers still scrape)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from loadtest.engine import EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# vLLM's NIXL connector buckets (nixl_connector.py, NixlPromMetrics).
_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


@dataclass
class Histogram:
    """A Prometheus histogram kept in-process (cumulative buckets rendered on demand)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        running = 0
        counts = self.counts or [0] * len(self.buckets)
        for le, c in zip(self.buckets, counts, strict=True):
            running += c
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


class LatencyStats:
    """TTFT and end-to-end latency histograms, in model seconds."""

    def __init__(self) -> None:
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.e2e = Histogram(_E2E_BUCKETS)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)


@dataclass
class TransferStats:
    """KV transfers under vLLM's NIXL connector metric names: time (model seconds) and bytes per
    transfer read by this worker, failed transfers (decode side), held KV that expired unread
    (prefill side)."""

    xfer_time: Histogram = field(default_factory=lambda: Histogram(_XFER_BUCKETS))
    bytes_transferred: Histogram = field(default_factory=lambda: Histogram(_BYTES_BUCKETS))
    num_failed: int = 0
    num_expired: int = 0

    def lines(self, labels: str) -> list[str]:
        out = self.xfer_time.lines("vllm:nixl_xfer_time_seconds", labels)
        out += self.bytes_transferred.lines("vllm:nixl_bytes_transferred", labels)
        out += [
            "# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.",
            "# TYPE vllm:nixl_num_failed_transfers counter",
            f"vllm:nixl_num_failed_transfers{{{labels}}} {self.num_failed}",
            "# HELP vllm:nixl_num_kv_expired_reqs Number of requests that had their KV expire.",
            "# TYPE vllm:nixl_num_kv_expired_reqs counter",
            f"vllm:nixl_num_kv_expired_reqs{{{labels}}} {self.num_expired}",
        ]
        return out


def render_metrics(
    model: str,
    stats: EngineStats,
    block_size: int,
    latency: LatencyStats,
    num_aborted: int,
    transfers: TransferStats | None = None,
    num_stopped: int = 0,
) -> str:
    """The /metrics body. `num_stopped`: finished requests a stop string or a tool call ended
    (vLLM's `finished_reason="stop"`), the others ran to their token limit."""
    lab = f'engine="0",model_name="{model}"'
    ran_to_limit = stats.num_finished_total - num_stopped
    queries, hits = stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens
    hit_rate = hits / queries if queries else 0.0
    # (type, name after "vllm:", value, help): V1 names, then the older aliases routers scrape.
    families: tuple[tuple[str, str, float, str], ...] = (
        ("gauge", "num_requests_running", stats.num_running,
         "Number of requests in model execution batches."),
        ("gauge", "num_requests_waiting", stats.num_waiting, "Number of requests waiting to be processed."),
        ("gauge", "kv_cache_usage_perc", stats.kv_usage, "KV-cache usage. 1 means 100 percent usage."),
        ("gauge", "gpu_cache_usage_perc", stats.kv_usage, "GPU KV-cache usage (older name)."),
        ("counter", "prefix_cache_queries_total", queries, "Prefix cache queries, in tokens."),
        ("counter", "prefix_cache_hits_total", hits, "Prefix cache hits, in tokens."),
        ("counter", "gpu_prefix_cache_queries_total", queries, "Prefix cache queries (older name)."),
        ("counter", "gpu_prefix_cache_hits_total", hits, "Prefix cache hits (older name)."),
        ("gauge", "gpu_prefix_cache_hit_rate", hit_rate, "Cumulative prefix cache hit rate (older name)."),
        ("counter", "prompt_tokens_total", stats.prompt_tokens_total, "Number of prefill tokens processed."),
        ("counter", "generation_tokens_total", stats.generation_tokens_total,
         "Number of generation tokens processed."),
        ("counter", "num_preemptions_total", stats.num_preemptions_total,
         "Cumulative number of preemptions."),
    )  # fmt: skip
    lines: list[str] = []
    for kind, name, value, help_text in families:
        lines += [
            f"# HELP vllm:{name} {help_text}",
            f"# TYPE vllm:{name} {kind}",
            f"vllm:{name}{{{lab}}} {value}",
        ]
    lines += [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{{lab},finished_reason="stop"}} {num_stopped}',
        f'vllm:request_success_total{{{lab},finished_reason="length"}} {ran_to_limit}',
        f'vllm:request_success_total{{{lab},finished_reason="abort"}} {num_aborted}',
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",'
        f'engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="{stats.num_kv_blocks}"}} 1.0',
    ]
    lines += latency.ttft.lines("vllm:time_to_first_token_seconds", lab)
    lines += latency.e2e.lines("vllm:e2e_request_latency_seconds", lab)
    if transfers is not None:
        lines += transfers.lines(lab)
    return "\n".join(lines) + "\n"
