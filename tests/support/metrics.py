"""Reading the gateway's own Prometheus text: in-process tests, or a `/metrics` page fetched."""

from __future__ import annotations

from gateway.state import GatewayState


def text_total(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s series in a Prometheus page whose labels include `labels` (0 when
    none does)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_total(state: GatewayState, name: str, **labels: str) -> float:
    """`text_total` over this in-process gateway's own metrics."""
    return text_total(state.routing.metrics.render().decode(), name, **labels)
