"""Fidelity: an isolated request's TTFT over HTTP equals the profile's modelled prefill time
within 5 ms, cached tokens skip their prefill, decode runs one token per modelled step, and
--time-scale divides wall time.

Every sample must take at least the modelled time (the engine really waits). For the 5 ms upper
bound the best sample counts, with up to ten attempts 0.2 s apart: on a shared 2-core machine other
processes can delay any single request, while a systematic overhead would fail every attempt.
Medians are reported by `python -m loadtest.emulator.fidelity` (docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from loadtest.emulator.fidelity import (
    emulator_process,
    measure_tpot,
    measure_ttft,
    modelled_tpot_s,
    random_prompt,
)
from loadtest.engine import load_profile

PROFILE = load_profile("llama3-8b-h100")
TOLERANCE_S = 0.005
MAX_ATTEMPTS = 10


def _best_ttfts(
    client: httpx.Client, base: str, n: int, rng: random.Random, time_scale: float, tolerance_s: float
) -> tuple[float, float, float, float]:
    """(best cold, best cached, modelled cold, modelled cached) TTFT in real seconds."""
    cached = (n - 1) // 16 * 16
    cold_model_s = PROFILE.isolated_prefill_s(n) / time_scale
    warm_model_s = PROFILE.isolated_prefill_s(n - cached, cached) / time_scale
    best_cold = best_warm = float("inf")
    for _ in range(MAX_ATTEMPTS):
        prompt = random_prompt(n, rng)
        cold = measure_ttft(client, base, prompt, "fid")
        warm = measure_ttft(client, base, prompt, "fid")
        assert cold.cached_tokens == 0 and warm.cached_tokens == cached
        assert cold.ttft_s >= cold_model_s - 0.001 and warm.ttft_s >= warm_model_s - 0.001
        best_cold, best_warm = min(best_cold, cold.ttft_s), min(best_warm, warm.ttft_s)
        if best_cold <= cold_model_s + tolerance_s and best_warm <= warm_model_s + tolerance_s:
            break
        time.sleep(0.2)  # let a burst of load from other processes pass
    return best_cold, best_warm, cold_model_s, warm_model_s


def test_isolated_ttft_matches_model_and_cache_skips_prefill() -> None:
    rng = random.Random(7)
    with emulator_process("--model", "fid") as base, httpx.Client(timeout=30) as client:
        measure_ttft(client, base, random_prompt(64, rng), "fid")  # warm-up
        for n in (1024, 4096):
            best_cold, best_warm, cold_model_s, warm_model_s = _best_ttfts(
                client, base, n, rng, 1.0, TOLERANCE_S
            )
            assert best_cold <= cold_model_s + TOLERANCE_S, (n, best_cold, cold_model_s)
            assert best_warm <= warm_model_s + TOLERANCE_S, (n, best_warm, warm_model_s)
            assert best_warm < best_cold
        # Decode: one token per modelled step; late wake-ups are caught up, not accumulated.
        tpot = measure_tpot(client, base, random_prompt(1024, rng), "fid", 60)
        assert tpot == pytest.approx(modelled_tpot_s("llama3-8b-h100", 1024, 60), rel=0.1)


def test_time_scale_divides_wall_time() -> None:
    rng = random.Random(8)
    scale = 10.0
    with (
        emulator_process("--model", "fid", "--time-scale", str(scale)) as base,
        httpx.Client(timeout=30) as client,
    ):
        measure_ttft(client, base, random_prompt(64, rng), "fid")  # warm-up
        # The 103 ms prefill of 4096 tokens takes about 10 ms of wall time (HTTP time is not scaled).
        best_cold, best_warm, cold_model_s, warm_model_s = _best_ttfts(
            client, base, 4096, rng, scale, TOLERANCE_S
        )
        assert best_cold <= cold_model_s + 2 * TOLERANCE_S < PROFILE.isolated_prefill_s(4096) / 4
        assert best_warm <= warm_model_s + 2 * TOLERANCE_S
        tpot = measure_tpot(client, base, random_prompt(1024, rng), "fid", 100)
        assert tpot == pytest.approx(modelled_tpot_s("llama3-8b-h100", 1024, 100) / scale, rel=0.15)
