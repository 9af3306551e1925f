"""A probe's verdict and the suite's table: `probe | expected | observed | ok`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one probe expected, what it saw, whether that is what it expected, and how long it took."""

    probe: str
    expected: str
    observed: str
    ok: bool
    duration_s: float = 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "probe": self.probe,
            "expected": self.expected,
            "observed": self.observed,
            "ok": self.ok,
            "duration_s": round(self.duration_s, 2),
        }


def table(verdicts: Sequence[Verdict]) -> str:
    """A Markdown table (also readable as plain text)."""
    rows = [("probe", "expected", "observed", "ok")]
    rows += [(v.probe, v.expected, v.observed, "yes" if v.ok else "**NO**") for v in verdicts]
    lines = [f"| {' | '.join(c.replace('|', '/') for c in row)} |" for row in rows]
    lines.insert(1, "|---|---|---|---|")
    return "\n".join(lines)


def mib(n_bytes: float) -> str:
    return f"{n_bytes / (1024 * 1024):.0f} MB"


def counts(values: Sequence[object]) -> str:
    """`{value: count}` in a compact form, most frequent first: `431×47, None×1`."""
    seen: dict[object, int] = {}
    for v in values:
        seen[v] = seen.get(v, 0) + 1
    return ", ".join(f"{k}×{n}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1]))
