"""Decision by decision: the HTTP run's choices against the simulator's on the same history.

A decision agrees when both chose the same worker; a different worker counts as a tie when, in the
simulator's view, the two were indistinguishable (same predicted hit, same in-flight requests and
prefill backlog), i.e. only the random tie-break told them apart. Each divergence names the
signals that differ between the two views for the two workers involved. Token counts are compared
as fractions of the prompt, since the gateway estimates request tokens (its normalizer) while the
simulator counts the engine's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loadtest.replay.forced import SimDecision
from loadtest.replay.log import Candidate, HttpDecision

SIGNALS = ("predicted", "in_flight", "prefill", "decode", "waiting", "running")


@dataclass(slots=True)
class Divergence:
    request_id: str
    http: HttpDecision
    sim: SimDecision
    signals: list[str]  # the SIGNALS whose values differ between the views, for either worker
    detail: list[str]


@dataclass(slots=True)
class Agreement:
    n: int = 0
    same: int = 0
    ties: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    agreed_by_reason: Counter[str] = field(default_factory=Counter)
    signals: Counter[str] = field(default_factory=Counter)
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return (self.same + self.ties) / self.n if self.n else 0.0


def _sim_signals(sim: SimDecision, worker: str) -> dict[str, float | int | None]:
    view = sim.views.get(worker)
    n = max(1, sim.n_prompt_tokens)
    if view is None:
        return dict.fromkeys(SIGNALS)
    return {
        "predicted": round(sim.predicted.get(worker, 0) / n, 2),
        "in_flight": view.in_flight_requests,
        "prefill": round(view.in_flight_prefill_tokens / n, 2),
        "decode": view.in_flight_decode_tokens,
        "waiting": view.num_requests_waiting,
        "running": view.num_requests_running,
    }


def _http_signals(http: HttpDecision, worker: str) -> dict[str, float | int | None]:
    found: Candidate | None = next((c for c in http.candidates if c.worker == worker), None)
    n = max(1, http.n_prompt_tokens)
    if found is None:
        return dict.fromkeys(SIGNALS)
    return {
        "predicted": round(found.predicted_cached_tokens / n, 2),
        "in_flight": found.in_flight,
        "prefill": round(found.prefill_tokens / n, 2),
        "decode": found.decode_tokens,
        "waiting": found.waiting,
        "running": found.running,
    }


def _tied(sim: SimDecision, a: str, b: str) -> bool:
    sa, sb = _sim_signals(sim, a), _sim_signals(sim, b)
    return all(sa[k] == sb[k] for k in ("predicted", "in_flight", "prefill"))


def compare(http: dict[str, HttpDecision], sim: dict[str, SimDecision], keep: int = 20) -> Agreement:
    out = Agreement()
    for rid, h in sorted(http.items(), key=lambda kv: kv[1].t_s):
        s = sim.get(rid)
        if s is None:
            continue
        out.n += 1
        out.by_reason[h.reason] += 1
        if s.worker == h.worker:
            out.same += 1
            out.agreed_by_reason[h.reason] += 1
            continue
        if s.worker is not None and _tied(s, s.worker, h.worker):
            out.ties += 1
            out.agreed_by_reason[h.reason] += 1
            continue
        differing: list[str] = []
        detail: list[str] = []
        for w in (w for w in (h.worker, s.worker) if w is not None):
            hs, ss = _http_signals(h, w), _sim_signals(s, w)
            for k in SIGNALS:
                if hs[k] != ss[k]:
                    if k not in differing:
                        differing.append(k)
                    detail.append(f"{w}.{k} http={hs[k]} sim={ss[k]}")
        out.signals.update(differing)
        if len(out.divergences) < keep:
            out.divergences.append(Divergence(rid, h, s, differing, detail))
    return out


def reason_agreement(http: dict[str, HttpDecision], sim: dict[str, SimDecision]) -> float:
    """The share of requests given the same reason (hit, miss, spread, ...) by both: comparable
    across runs whose worker names drifted apart."""
    both = [rid for rid in http if rid in sim]
    return sum(http[rid].reason == sim[rid].reason for rid in both) / len(both) if both else 0.0


def render(a: Agreement) -> str:
    lines = [
        f"decisions compared: {a.n}; same worker {a.same}, tied {a.ties}; agreement {a.ratio:.1%}",
        "",
        "| HTTP reason | decisions | agree | agreement |",
        "|---|---:|---:|---:|",
    ]
    for reason, n in a.by_reason.most_common():
        ok = a.agreed_by_reason[reason]
        lines.append(f"| {reason} | {n} | {ok} | {ok / n:.1%} |")
    if a.signals:
        lines += [
            "",
            "signals differing in divergences: " + ", ".join(f"{k} {v}" for k, v in a.signals.most_common()),
        ]
    if a.divergences:
        lines += ["", "first divergences (HTTP worker / reason vs simulator's):"]
    for d in a.divergences:
        lines.append(
            f"- {d.request_id} t={d.http.t_s:.3f}s http {d.http.worker}/{d.http.reason} "
            f"sim {d.sim.worker}/{d.sim.reason}: " + "; ".join(d.detail)
        )
    return "\n".join(lines)
