"""The metric families the gateway keeps itself instead of through prometheus_client.

The per-request series (requests, latencies, tokens, decisions, retries) are plain numbers per
label tuple, written only from the event loop and turned into Prometheus families when scraped:
prometheus_client's own counters take a lock and a label lookup on every increment, which was a
measurable share of the gateway's CPU per request. A policy's counters are kept by the policy and
copied in at scrape time (`SnapshotCounter`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class CounterChild:
    """One label tuple's running total."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One label tuple's bucket counts (not cumulative: made so at scrape time), sum and count."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is the +Inf bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # first bucket whose bound is >= value
        self.sum += value


class HotCounter:
    """A counter family: `labels(...)` gives the child of one label tuple (created once)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.children: dict[tuple[str, ...], CounterChild] = {}

    def labels(self, *values: str) -> CounterChild:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = CounterChild()
        return child

    def metric(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)
        return family


class HotHistogram:
    """A histogram family with fixed bucket bounds (seconds)."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], bounds: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = tuple(bounds)
        self.children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = HistogramChild(self.bounds)
        return child

    def metric(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip((*self.bounds, float("inf")), child.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric(values, buckets, child.sum)
        return family


class SnapshotCounter(Collector):
    """A counter family whose totals are kept elsewhere (a policy's own counters) and copied in
    at scrape time with `set`; `clear` first, so a label tuple that is gone stops being exported."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = value

    def clear(self) -> None:
        self.values.clear()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        yield family


class HotCollector(Collector):
    """Exports the hot families at scrape time, in the order they were declared."""

    def __init__(self) -> None:
        self._families: list[HotCounter | HotHistogram] = []

    def counter(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> HotCounter:
        family = HotCounter(name, documentation, labelnames)
        self._families.append(family)
        return family

    def histogram(
        self, name: str, documentation: str, labelnames: tuple[str, ...], bounds: Sequence[float]
    ) -> HotHistogram:
        family = HotHistogram(name, documentation, labelnames, bounds)
        self._families.append(family)
        return family

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()
