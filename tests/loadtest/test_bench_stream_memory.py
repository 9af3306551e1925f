"""The stream-memory benchmark against this checkout's gateway: its clients' streams stall at the
gateway, which holds their unread bytes within the process-wide bound."""

from __future__ import annotations

from pathlib import Path

from gateway.stream_body import STREAM_PAUSE_BYTES, STREAM_TIGHT_BYTES
from loadtest.bench_stream_memory import run

ROOT = Path(__file__).resolve().parents[2]


async def test_stalled_streams_are_held_within_the_budget_and_a_read_per_stream() -> None:
    budget = 1024 * 1024
    result = await run(ROOT, streams=6, workers=1, stream_mb=64, budget=budget, settle_s=0.3)
    assert result["streams"] == 6 and result["finished"] == 0
    buffered = float(result["stream_bytes_buffered_mb"]) * 1024 * 1024  # type: ignore[arg-type]
    # The stream that crossed the budget stops at its own threshold, the others at the tight one,
    # each past it by at most what one socket read brings (256 KiB); the figure is rounded.
    one_read = 256 * 1024
    bound = budget + STREAM_PAUSE_BYTES + one_read + 6 * (STREAM_TIGHT_BYTES + one_read)
    assert 0 < buffered <= bound + 0.05 * 1024 * 1024
