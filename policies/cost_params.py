"""The constants of a pool's cost model and the named engine profiles they come from.

`CostModelParams` holds the step model's coefficients (the formula is in `policies.cost_model`),
the calibration's bounds and the KV-transfer terms; `PROFILES` are shared/reference/engine-timing.md
§6 measured per model and GPU; `profile` picks one with overrides, as a policy file does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class CostModelParams:
    """Constants of one pool's cost model, in seconds (see the module docstring for the formula)."""

    step_s: float = 0.0065
    prefill_s_per_token: float = 22e-6
    attention_s_per_pair: float = 1.3e-9
    decode_s_per_request: float = 5e-6
    decode_s_per_context_token: float = 5.2e-8
    max_batched_tokens: int = 8192
    ingestion_s: float = 0.01
    calibrate: bool = True
    calibration_weight: float = 0.05
    min_scale: float = 0.2
    max_scale: float = 5.0
    transfer_enabled: bool = False
    transfer_bytes_per_token: int = 131_072
    transfer_bandwidth_bytes_per_s: float = 25e9
    transfer_setup_s: float = 0.005
    cold_adapter_s: float = 1.0
    warming_s: float = 5.0
    # Share of the calibrated prefill rate counted as progress on a worker's pending prompts since
    # their backlog last restarted (`CostModel.prefill_remaining`); 0: none, the backlog is whole.
    prefill_progress: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if not 0.0 <= self.prefill_progress <= 1.0:
            raise ValueError("prefill_progress must be in [0, 1]")
        if not 0.0 <= self.calibration_weight <= 1.0:
            raise ValueError("calibration_weight must be in [0, 1]")
        if not 0.0 < self.min_scale <= 1.0 <= self.max_scale:
            raise ValueError("need 0 < min_scale <= 1 <= max_scale")
        if self.transfer_bandwidth_bytes_per_s <= 0:
            raise ValueError("transfer_bandwidth_bytes_per_s must be > 0")


# Profiles from engine-timing.md §6 (a, b, c, d, e converted from ms to s).
PROFILES: dict[str, CostModelParams] = {
    "llama3-8b-h100": CostModelParams(),
    "llama3-70b-h100-tp4": CostModelParams(
        step_s=0.017,
        prefill_s_per_token=65e-6,
        attention_s_per_pair=1.6e-9,
        decode_s_per_request=10e-6,
        decode_s_per_context_token=3.3e-8,
        transfer_bytes_per_token=81_920,
    ),
    "llama3-8b-a100": CostModelParams(
        step_s=0.011,
        prefill_s_per_token=65e-6,
        attention_s_per_pair=2.8e-9,
        decode_s_per_request=8e-6,
        decode_s_per_context_token=8.6e-8,
        max_batched_tokens=2048,
    ),
}


def profile(name: str, **overrides: object) -> CostModelParams:
    """A named profile with some constants overridden; an unknown name lists the known ones."""
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    return replace(base, **overrides)  # type: ignore[arg-type]


def transfer_time_s(tokens: int, setup_s: float, bytes_per_token: int, bandwidth_bytes_per_s: float) -> float:
    """T_transfer: moving `tokens` of KV between workers, `setup + tokens · bytes / bandwidth`;
    nothing moves (no setup either) when there is nothing to move."""
    if tokens <= 0:
        return 0.0
    return setup_s + tokens * bytes_per_token / bandwidth_bytes_per_s
