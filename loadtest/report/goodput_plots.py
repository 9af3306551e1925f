"""PNG plot of a goodput search: TTFT p99 and SLO attainment against the load, per policy.

matplotlib is imported when a plot is drawn, not with this module, so a run without it still
prints its tables; `PlotUnavailable` says how to get it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message names the install command."""


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One measured load (a rate scale, or users). `complete` False: the replay stopped once it
    had failed, so `attainment` is an upper bound and `ttft_p99_s` is None."""

    load: float
    attainment: float
    ttft_p99_s: float | None
    complete: bool = True


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            "matplotlib is not installed, so no plot was drawn: pip install 'kvgate[bench]' "
            "(or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def goodput_curves(
    title: str,
    curves: Mapping[str, Sequence[CurvePoint]],
    *,
    ttft_slo_s: float,
    share: float,
    path: Path,
    capacities: Mapping[str, float | None] | None = None,
    load_label: str | None = None,
) -> None:
    """Two panels sharing a log load axis (the rate scale unless `load_label` names another):
    TTFT p99 (log, SLO dashed) and attainment (share dashed). A stopped replay is drawn as a
    hollow downward triangle at its attainment bound."""
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter

    fig, (ax_t, ax_a) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for i, (policy, points) in enumerate(curves.items()):
        color = f"C{i % 10}"
        pts = sorted(points, key=lambda p: p.load)
        full = [p for p in pts if p.complete]
        with_ttft = [p for p in full if p.ttft_p99_s is not None]
        ax_t.plot(
            [p.load for p in with_ttft],
            [p.ttft_p99_s for p in with_ttft],
            marker="o",
            markersize=3,
            color=color,
            label=policy,
        )
        ax_a.plot([p.load for p in full], [p.attainment for p in full], marker="o", markersize=3, color=color)
        stopped = [p for p in pts if not p.complete]
        ax_a.scatter(
            [p.load for p in stopped],
            [p.attainment for p in stopped],
            marker="v",
            facecolors="none",
            edgecolors=color,
        )
        cap = (capacities or {}).get(policy)
        if cap is not None:
            ax_a.axvline(cap, color=color, linestyle=":", linewidth=0.8)
    ax_t.axhline(ttft_slo_s, color="black", linestyle="--", linewidth=0.8, label=f"TTFT SLO {ttft_slo_s:g} s")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("TTFT p99 (s, log)")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8, ncol=2)
    ax_a.axhline(share, color="black", linestyle="--", linewidth=0.8)
    ax_a.set_ylabel("share meeting TTFT and TPOT SLOs")
    ax_a.set_xlabel(load_label or "arrival rate scale (× the trace's own rate, log)")
    ax_a.set_xscale("log")
    for axis in (ax_a.xaxis, ax_t.yaxis):  # plain numbers on the log axes, not powers of ten
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))
    lowest = min((p.attainment for pts in curves.values() for p in pts), default=0.0)
    ax_a.set_ylim(max(0.0, min(lowest, share) - 0.05), 1.01)  # zoomed on where the curves cross
    ax_a.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
