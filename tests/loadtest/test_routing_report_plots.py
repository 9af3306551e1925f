"""The routing report links its plots only when they were drawn (matplotlib is the `bench` extra)."""

from __future__ import annotations

from loadtest.report.routing import markdown_report

SUMMARY = {
    "n_ok": 1,
    "n_sent": 1,
    "ttft_p50_s": 0.1,
    "ttft_p99_s": 0.2,
    "ttft_mean_s": 0.1,
    "e2e_p99_s": 0.3,
    "hit_ratio": 0.5,
    "imbalance": 1.0,
}


def test_plots_are_linked_only_when_drawn() -> None:
    ceilings = {"infinite": 0.6, "pooled_lru": 0.55}
    args = ({"workers": 2}, {"kvgate:cost": {**SUMMARY, "status": "ok"}}, ceilings, "kvgate:cost")
    assert "ttft_cdf.png" in markdown_report(*args)
    skipped = markdown_report(*args, plots=False)
    assert ".png" not in skipped and "Plots skipped" in skipped
