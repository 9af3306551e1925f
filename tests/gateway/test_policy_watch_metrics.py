"""Policy reloads in Prometheus: `kvgate_policy_reloads_total` by result, and
`kvgate_policy_reload_failing` while the running policy is not the file's."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.policy_watch import PolicyWatcher
from tests.gateway.test_policy_watch import Swaps, write


def _samples(metrics: GatewayMetrics) -> dict[str, float]:
    """The policy reload series of a rendered /metrics page, by name and result."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("kvgate_policy_reload"):
                result = sample.labels.get("result")
                out[f"{sample.name}{{{result}}}" if result else sample.name] = sample.value
    return out


async def test_reload_results_are_counted_and_a_failing_file_is_flagged(policy_file: Path) -> None:
    metrics = GatewayMetrics()
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    w.export_to(metrics)
    assert _samples(metrics) == {
        "kvgate_policy_reloads_total{applied}": 0.0,
        "kvgate_policy_reloads_total{rejected}": 0.0,
        "kvgate_policy_reloads_total{unchanged}": 0.0,
        "kvgate_policy_reload_failing": 0.0,
    }

    write(policy_file, "policy: least_load\n")
    assert (await w.check()) is not None
    write(policy_file, "policy: no_such_policy\n")
    assert (await w.check()) is not None
    assert await w.check() is None  # polled again: not another reload
    seen = _samples(metrics)
    assert seen["kvgate_policy_reloads_total{applied}"] == 1.0
    assert seen["kvgate_policy_reloads_total{rejected}"] == 1.0
    assert seen["kvgate_policy_reload_failing"] == 1.0

    write(policy_file, "policy: least_load\n")  # the bad edit reverted: the running policy is the file's
    result = await w.check()
    assert result is not None and result.unchanged
    seen = _samples(metrics)
    assert seen["kvgate_policy_reloads_total{unchanged}"] == 1.0
    assert seen["kvgate_policy_reload_failing"] == 0.0

    write(policy_file, "policy: [\n")
    assert (await w.reload_now()).error is not None
    assert _samples(metrics)["kvgate_policy_reload_failing"] == 1.0
    write(policy_file, "policy: round_robin\n")
    assert (await w.reload_now()).swapped
    seen = _samples(metrics)
    assert seen["kvgate_policy_reloads_total{applied}"] == 2.0
    assert seen["kvgate_policy_reloads_total{rejected}"] == 2.0
    assert seen["kvgate_policy_reload_failing"] == 0.0


def test_without_a_policy_file_there_are_no_reload_counts() -> None:
    seen = _samples(GatewayMetrics())
    assert seen == {"kvgate_policy_reload_failing": 0.0}
