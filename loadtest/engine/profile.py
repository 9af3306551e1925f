"""Step-time profiles: the cost of one engine forward pass, with constants read from YAML.

    t_step = a + b * max(0, N - N0) + c * R + d * K + e * A

N = scheduled tokens (prefill-chunk tokens plus one per decode), R = scheduled requests,
K = sum of the context lengths of the decoding requests (KV tokens read), A = sum over prefill
chunks of m * (p + m / 2) (m chunk tokens, p tokens already in KV) = causal attention pairs.
Below the knee N0 a step is memory-bound (weights read once), above it GEMMs are compute-bound.

Moving a prompt's KV from a prefill engine to a decode engine (P/D disaggregation) takes

    T_transfer(n) = setup + n * kv_bytes_per_token / kv_transfer_bytes_per_s     (0 when n = 0)

with n the tokens whose KV moves. Each YAML file in `loadtest/profiles/` states where its
constants come from.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_PROFILE = "llama3-8b-h100"


class ProfileError(ValueError):
    """A profile name is unknown or its YAML is malformed."""


class StepProfile(BaseModel):
    """One engine configuration: step-time constants (ms), KV pool size and scheduler limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    source: str
    a_ms: float = Field(ge=0)
    b_ms_per_token: float = Field(ge=0)
    knee_tokens: int = Field(ge=0)
    c_ms_per_request: float = Field(ge=0)
    d_ms_per_context_token: float = Field(ge=0)
    e_ms_per_attention_pair: float = Field(ge=0)
    kv_blocks: int = Field(gt=0)
    block_size_tokens: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    max_num_seqs: int = Field(gt=0)
    kv_bytes_per_token: int = Field(gt=0)  # the whole model's K and V, all tensor-parallel ranks
    kv_transfer_bytes_per_s: float = Field(gt=0)  # one transfer, all ranks' links together
    kv_transfer_setup_ms: float = Field(ge=0)  # fixed cost per transfer (request, notification)

    def step_time_s(
        self, num_tokens: int, num_requests: int, decode_context_tokens: int, attention_pairs: float
    ) -> float:
        """Modelled duration of one step, in seconds."""
        ms = (
            self.a_ms
            + self.b_ms_per_token * max(0, num_tokens - self.knee_tokens)
            + self.c_ms_per_request * num_requests
            + self.d_ms_per_context_token * decode_context_tokens
            + self.e_ms_per_attention_pair * attention_pairs
        )
        return ms / 1000.0

    def kv_transfer_s(self, num_tokens: int) -> float:
        """Modelled time to move the KV of `num_tokens` tokens between two engines, in seconds.

        Nothing moves for zero tokens (the decode engine already held the whole prompt), so no
        setup is paid either.
        """
        if num_tokens < 0:
            raise ValueError("num_tokens must not be negative")
        if num_tokens == 0:
            return 0.0
        return (
            self.kv_transfer_setup_ms / 1000.0
            + num_tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s
        )

    def isolated_prefill_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Modelled TTFT (compute only) of one request alone on an idle engine.

        The prompt's uncached part runs in chunks of `max_num_batched_tokens`, one step each; the
        first token is produced at the end of the step that runs the last chunk.
        """
        total_s = 0.0
        done = num_cached_tokens
        left = num_new_tokens
        while left > 0:
            m = min(left, self.max_num_batched_tokens)
            total_s += self.step_time_s(m, 1, 0, m * (done + m / 2.0))
            done += m
            left -= m
        return total_s


def known_profiles() -> list[str]:
    """Names of the profiles shipped in `loadtest/profiles/`."""
    root = resources.files("loadtest.profiles")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def parse_profile(text: str) -> StepProfile:
    """Parse one profile YAML document; ProfileError names the bad field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError("profile must be a YAML mapping")
    try:
        return StepProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ProfileError(f"profile field {field!r}: {first['msg']}") from exc


def load_profile(name_or_path: str) -> StepProfile:
    """Load a shipped profile by name, or any profile YAML by file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return parse_profile(path.read_text(encoding="utf-8"))
    names = known_profiles()
    if name_or_path not in names:
        raise ProfileError(f"unknown profile {name_or_path!r}; known: {', '.join(names)}")
    text = resources.files("loadtest.profiles").joinpath(f"{name_or_path}.yaml").read_text(encoding="utf-8")
    return parse_profile(text)
