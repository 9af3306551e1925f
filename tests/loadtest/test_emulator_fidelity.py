"""Fidelity, as far as a shared machine lets a test say it: the engine really waits its modelled
time (every sample takes at least the modelled prefill and decode step), cached tokens skip their
prefill, and --time-scale divides wall time.

Nothing here bounds a wall-clock time from above: other processes can delay any request by any
amount. Upper bounds are compared within one run (cached against cold, scaled against unscaled),
each side the best of a few samples. How close the emulator comes to its model is a benchmark:
`python -m loadtest.emulator.fidelity` prints medians against the modelled times
(docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from loadtest.emulator.fidelity import (
    measure_ttft,
    modelled_tpot_s,
    random_prompt,
)
from loadtest.engine import load_profile
from tests.support.processes import running_emulator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROFILE = load_profile("llama3-8b-h100")
SAMPLES = 3
N_TOKENS = 4096
DECODE_PROMPT_TOKENS = 1024


def _decode_s(client: httpx.Client, base: str, prompt: str, tokens_out: int) -> tuple[float, float]:
    """Stream one completion: (time from sending to its last token, mean time between tokens).

    The first is bounded below by the model: the step loop never delivers a step before its
    modelled end. The second is not: a first token delivered late is followed by tokens that
    catch up with the schedule, so the mean between tokens may dip below a modelled step."""
    body = {"model": "fid", "prompt": prompt, "max_tokens": tokens_out, "stream": True}
    stamps: list[float] = []
    began = time.perf_counter()
    with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    assert len(stamps) == tokens_out
    return stamps[-1] - began, (stamps[-1] - stamps[0]) / (tokens_out - 1)


def _best_ttfts(
    client: httpx.Client, base: str, rng: random.Random, time_scale: float
) -> tuple[float, float]:
    """(best cold, best cached) TTFT in real seconds; every sample at least its modelled time."""
    cached = (N_TOKENS - 1) // 16 * 16
    cold_model_s = PROFILE.isolated_prefill_s(N_TOKENS) / time_scale
    warm_model_s = PROFILE.isolated_prefill_s(N_TOKENS - cached, cached) / time_scale
    colds, warms = [], []
    for _ in range(SAMPLES):
        prompt = random_prompt(N_TOKENS, rng)
        cold = measure_ttft(client, base, prompt, "fid")
        warm = measure_ttft(client, base, prompt, "fid")
        assert (cold.cached_tokens, warm.cached_tokens) == (0, cached)
        assert cold.ttft_s >= cold_model_s - 0.001, (cold.ttft_s, cold_model_s)
        assert warm.ttft_s >= warm_model_s - 0.001, (warm.ttft_s, warm_model_s)
        colds.append(cold.ttft_s)
        warms.append(warm.ttft_s)
    return min(colds), min(warms)


def test_engine_waits_its_model_cache_skips_prefill_and_time_scale_divides() -> None:
    rng = random.Random(7)
    tokens_out = 40
    tpot_model_s = modelled_tpot_s("llama3-8b-h100", DECODE_PROMPT_TOKENS, tokens_out)
    decode_model_s = PROFILE.isolated_prefill_s(DECODE_PROMPT_TOKENS) + tpot_model_s * (tokens_out - 1)
    with httpx.Client(timeout=30) as client:
        with running_emulator("--model", "fid") as base:
            measure_ttft(client, base, random_prompt(64, rng), "fid")  # warm-up
            cold_s, warm_s = _best_ttfts(client, base, rng, 1.0)
            decode_s, tpot_s = _decode_s(client, base, random_prompt(DECODE_PROMPT_TOKENS, rng), tokens_out)
        with running_emulator("--model", "fid", "--time-scale", "10") as base:
            measure_ttft(client, base, random_prompt(64, rng), "fid")
            scaled_cold_s, _ = _best_ttfts(client, base, rng, 10.0)
            _, scaled_tpot_s = _decode_s(client, base, random_prompt(DECODE_PROMPT_TOKENS, rng), tokens_out)
    # A cached prompt costs one minimal step, far below a 4096-token prefill (~100 ms modelled).
    assert warm_s < cold_s / 2, (warm_s, cold_s)
    # Decode runs at least one modelled step per token: the last token comes no sooner than the
    # modelled prefill and decode steps after the request was sent.
    assert decode_s >= decode_model_s - 0.001, (decode_s, decode_model_s)
    # Ten times faster virtual time: well under half the unscaled wall time, prefill and decode.
    assert scaled_cold_s < cold_s / 2, (scaled_cold_s, cold_s)
    assert scaled_tpot_s < tpot_s / 2, (scaled_tpot_s, tpot_s)
