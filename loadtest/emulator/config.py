"""Settings of one emulated worker (from the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
