"""Settings of one emulated worker (from the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode", "mixed"]
KvLoadFailurePolicy = Literal["fail", "recompute"]


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Everything `python -m loadtest.emulator` is told; None means "the profile's value"."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "emulated-llama"
    profile: str = "llama3-8b-h100"
    kv_blocks: int | None = None
    block_size: int | None = None
    time_scale: float = 1.0
    seed: int = 0
    tokenizer: str | None = None
    default_max_tokens: int = 128
    max_model_len: int = 131072
    max_waiting_requests: int = 4096
    jitter_frac: float = 0.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_encoding: Literal["array", "map"] = "array"
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10000
    # Prefill/decode disaggregation (docs/pd.md). Timeouts are real seconds, not model time.
    role: Role = "mixed"
    # "sglang": a decode-role worker refuses a generation request without `bootstrap_room`, as an
    # SGLang decode server admits only KV computed elsewhere; "any": it runs one whole, as a vLLM
    # decode server does.
    pd_protocol: Literal["any", "sglang"] = "any"
    kv_engine_id: str | None = None  # None: a random id per process, as vLLM's engine_id
    kv_advertise_host: str | None = None  # the host decode workers pull from (None: --host)
    bootstrap_port: int | None = None  # a second listener, as SGLang's prefill bootstrap port
    kv_transfer_timeout_s: float = 300.0  # SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT
    kv_bootstrap_timeout_s: float = 300.0  # SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
    kv_hold_timeout_s: float = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    kv_load_failure_policy: KvLoadFailurePolicy = "fail"  # vLLM's kv_load_failure_policy
    api_key: str | None = None  # vLLM's --api-key: /v1 routes want `Authorization: Bearer <key>`
