"""Reading the gateway's own Prometheus text in in-process tests."""

from __future__ import annotations

from gateway.state import GatewayState


def metric_total(state: GatewayState, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels` (0 when none does)."""
    text = state.routing.metrics.render().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
