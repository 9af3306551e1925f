"""PNG plots of a routing benchmark (matplotlib, Agg backend: no display needed).

matplotlib comes with the `kvgate[bench]` extra and is imported on the first plot. Without it
each plot is skipped and the run says so once on stderr; the report and results.json are written
all the same.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from loadtest.report.sampler import LoadSample

BENCH_EXTRA = "kvgate[bench]"


@functools.cache
def _pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (said once) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(
            f"plots skipped: matplotlib is not installed (pip install '{BENCH_EXTRA}')",
            file=sys.stderr,
            flush=True,
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: Path) -> bool:
    """Step CDF of TTFT per router; False when skipped (no matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in ttfts.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=np.float64))
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per router")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def hit_ratio_bars(
    hits: Mapping[str, float], ceiling_infinite: float, ceiling_pooled_lru: float, path: Path
) -> bool:
    """Hit ratio per router against both ceilings; False when skipped (no matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(hits)
    ax.bar(names, [hits[n] for n in names], color="tab:blue")
    ax.axhline(
        ceiling_infinite,
        color="tab:red",
        linestyle="--",
        label=f"infinite-cache ceiling {ceiling_infinite:.3f}",
    )
    ax.axhline(
        ceiling_pooled_lru,
        color="tab:orange",
        linestyle=":",
        label=f"pooled-LRU ceiling {ceiling_pooled_lru:.3f}",
    )
    ax.set_ylabel("prefix-cache hit ratio (token-weighted)")
    # Head room above the ceiling lines for the legend.
    ax.set_ylim(0, max(1e-3, ceiling_infinite, *hits.values()) * 1.35)
    ax.set_title("Hit ratio against the ceiling")
    ax.legend(loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load_over_time(loads: Mapping[str, Sequence[LoadSample]], n_workers: int, path: Path) -> bool:
    """Running + waiting per worker over time, one panel per router; False when skipped."""
    plt = _pyplot()
    if plt is None:
        return False
    routers = [r for r in loads if loads[r]]
    fig, axes = plt.subplots(
        len(routers) or 1, 1, figsize=(8, 2.6 * max(len(routers), 1)), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], routers, strict=False):
        samples = loads[name]
        for w in range(n_workers):
            pts = [(s.t_s, s.running + s.waiting) for s in samples if s.worker == w]
            if pts:
                t, v = zip(*pts, strict=True)
                ax.plot(t, v, label=f"w{w}", linewidth=1)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("running + waiting")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time since start (s)")
    if routers:
        axes[0, 0].legend(ncol=min(n_workers, 8), fontsize=7, loc="upper right")
    fig.suptitle("Per-worker load over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
