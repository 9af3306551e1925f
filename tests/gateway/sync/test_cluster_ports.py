"""The cluster tests' ports: no node's port is another node's cluster bus port (+10000)."""

from __future__ import annotations

import pytest

from tests.gateway.sync import clusters


def test_no_node_port_is_another_nodes_bus_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI picked 39625, 47577 and 49625 for one cluster: 49625 was 39625's bus port, so that node
    # could not bind it, and the test talked to the other node's bus.
    monkeypatch.setattr(clusters, "_TAKEN", set())
    picks = iter([39625, 49625, 47577])
    monkeypatch.setattr(clusters, "free_port", lambda: next(picks))
    assert [clusters.cluster_node_port() for _ in range(2)] == [39625, 47577]
