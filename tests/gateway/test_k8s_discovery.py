"""Kubernetes discovery against a fake API server on 127.0.0.1 that speaks the real list/watch
protocol: pods added, removed or turned unready change the routed set within 2 s; lists are paged
and capped; in-cluster access over TLS; what holds or ends the start; the gateway routing to the
pods found. What a failed watch does: `test_k8s_watch_failures.py`."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import certifi
import pytest

from gateway.auth import hash_api_key
from gateway.discovery import Discovery
from gateway.k8s.api import KubernetesSetupError
from gateway.k8s.config import KubernetesDiscoveryConfig
from gateway.k8s.source import PodWatcher
from policies import make_policy
from policies.base import WorkerId
from tests.gateway.fake_kube_api import FakeKubeApi, make_pod
from tests.gateway.k8s_follow import follow, url
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_health_only
from tests.support.processes import free_port
from tests.support.wait import wait_until

TLS = Path(__file__).parent / "data" / "k8s_tls"


async def test_pods_added_removed_or_turned_unready_change_the_routed_set(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.put(make_pod("a", port=8001))
    fake.put(make_pod("b", port=8002, ready=False))
    fake.put(make_pod("other", port=8003, labels={"app": "other"}))  # not selected
    async with follow(fake, tmp_path) as f:
        assert f.current == {url(8001)}  # populated before start() returned
        fake.put(make_pod("c", port=8004))
        await f.routed(8001, 8004)
        fake.ready("a", False)
        await f.routed(8004)
        fake.ready("b", True)
        await f.routed(8002, 8004)
        fake.delete("c")
        await f.routed(8002)
        draining = make_pod("b", port=8002)
        draining["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        fake.put(draining)
        await f.routed()
        fake.put(make_pod("d", port=8005, phase="Pending", ready=False))
        fake.put(make_pod("d", port=8005))
        await f.routed(8005)
        fake.put(make_pod("d", port=8005, labels={"app": "retired"}))  # relabelled out of the selector
        await f.routed()
        fake.put(make_pod("other", port=8003))  # relabelled into it
        await f.routed(8003)
        assert f.errors == [] and fake.lists == 1  # everything came through one watch
        assert [sorted(c.added) for c in f.changes][:2] == [[url(8001)], [url(8004)]]


async def test_a_pod_with_a_malformed_annotation_or_port_is_its_own_problem(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    typo = {"kvgate.io/kv": "tcp://{host.ip}:5557"}  # `{host.ip}` for `{host}`
    fake.put(make_pod("a", port=8001, annotations=typo))
    fake.put(make_pod("b", port=8002, annotations={"kvgate.io/kv": "5557"}))
    async with follow(fake, tmp_path, {"kv_events_annotation": "kvgate.io/kv"}) as f:
        assert f.current == {url(8001), url(8002)}  # the first list, not a retried one
        assert f.changes[0].details_of(url(8001)).kv_events_endpoint is None
        junk_port = make_pod("c", port=8003)
        junk_port["spec"]["containers"][0]["ports"].insert(0, "http")
        fake.put(junk_port)  # and through the watch
        await f.routed(8001, 8002, 8003)
        assert f.errors == [] and fake.lists == 1


async def test_lists_are_paged_and_the_routed_set_is_capped(fake: FakeKubeApi, tmp_path: Path) -> None:
    for i in range(5):
        fake.put(make_pod(f"p{i}", port=8000 + i))
    async with follow(fake, tmp_path, page_size=2) as f:
        assert f.current == {url(8000 + i) for i in range(5)} and fake.lists == 1
    async with follow(fake, tmp_path, {"max_pods": 3}) as f:
        assert f.current == {url(8000), url(8001), url(8002)}
        fake.delete("p0")  # a pod that waited for a place takes it
        await f.routed(8001, 8002, 8003)
        fake.put(make_pod("a-late", port=8009))  # a newcomer never displaces a routed pod
        fake.delete("p1")
        await f.routed(8002, 8003, 8004)
        await wait_until(lambda: bool(fake.watchers))
        fake.expire()  # nor does a relist, whatever order the list comes in
        await wait_until(lambda: f.watcher.lists == 2)
        assert f.current == {url(8002), url(8003), url(8004)}
        fake.put(make_pod("p5", port=8005))
        fake.delete("p2")  # and the one that waited longest takes the place
        await f.routed(8003, 8004, 8009)


async def test_a_page_too_large_is_asked_for_again_with_fewer_pods(fake: FakeKubeApi, tmp_path: Path) -> None:
    """Pages are 250 pods and 8 MiB at most (a parsed page takes about 8-9 times its JSON in
    memory); a page over the cap is asked for again, halved, from the same continue token."""
    blob = "x" * (1024 * 1024)  # about 1 MiB a pod (etcd keeps none over 1.5 MiB)
    for i in range(10):
        fake.put(make_pod(f"p{i}", port=8000 + i, annotations={"note": blob}))
    async with follow(fake, tmp_path) as f:
        assert f.current == {url(8000 + i) for i in range(10)}
        assert f.errors == [] and f.watcher.lists == 1 and f.resyncs == 0
        assert fake.list_limits == ["250", "125", "62", "31", "15", "7", "7"]
        fake.put(make_pod("p10", port=8010))  # and the watch follows on
        await f.routed(*range(8000, 8011))


async def test_a_rolling_update_past_max_pods_keeps_the_pool_full(fake: FakeKubeApi, tmp_path: Path) -> None:
    """maxSurge makes a rollout briefly exceed the pods it replaces: the surplus waits, and takes
    the place of each old pod that leaves."""
    for i in range(3):
        fake.put(make_pod(f"old-{i}", port=8000 + i))
    async with follow(fake, tmp_path, {"max_pods": 3}) as f:
        await f.routed(8000, 8001, 8002)
        for i in range(3):
            fake.put(make_pod(f"new-{i}", port=9000 + i))  # surge: ready before the old one goes
            fake.delete(f"old-{i}")
        await f.routed(9000, 9001, 9002)
        assert fake.lists == 1 and f.errors == []


async def test_roles_and_kv_endpoints_travel_with_the_change(fake: FakeKubeApi, tmp_path: Path) -> None:
    role = {"app": "vllm", "kvgate.io/role": "prefill"}
    fake.put(make_pod("a", port=8001, labels=role, annotations={"kvgate.io/kv": "5557"}))
    config = {"role_label": "kvgate.io/role", "kv_events_annotation": "kvgate.io/kv"}
    async with follow(fake, tmp_path, config) as f:
        first = f.changes[0].details_of(url(8001))
        assert first.role == "prefill" and first.kv_events_endpoint == "tcp://127.0.0.1:5557"
        fake.put(make_pod("a", port=8001, labels={**role, "kvgate.io/role": "decode"}))
        await wait_until(lambda: len(f.changes) == 2)
        assert f.changes[1].changed == {url(8001)} and not f.changes[1].added
        assert f.changes[1].details_of(url(8001)).role == "decode"
        assert f.changes[1].details_of(url(8001)).kv_events_endpoint is None


def _service_account(tmp_path: Path, ca: Path) -> Path:
    """A pod's service-account directory: the token the fake API server takes, its namespace,
    and `ca` as the CA bundle."""
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token\n")
    (sa / "namespace").write_text("serving")
    shutil.copy(ca, sa / "ca.crt")
    return sa


@contextlib.asynccontextmanager
async def _in_cluster_api() -> AsyncIterator[tuple[FakeKubeApi, int]]:
    """A fake API server over TLS (the test CA's certificate) for namespace `serving`, as a
    service account sees it, and its port."""
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(TLS / "server.crt", TLS / "server.key")
    api = FakeKubeApi(namespace="serving", token="sa-token")
    port = await api.start(ssl_context=server_tls)
    try:
        yield api, port
    finally:
        await api.stop()


async def test_in_cluster_over_tls_with_the_service_account(tmp_path: Path) -> None:
    async with _in_cluster_api() as (api, port):
        api.put(make_pod("a", port=8001))
        sa = _service_account(tmp_path, TLS / "ca.crt")
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
        config = KubernetesDiscoveryConfig(selector="app=vllm", port="http")
        discovery = Discovery(PodWatcher(config, environ=env, sa_dir=sa))
        await discovery.start(lambda change: None)
        try:
            assert discovery.current == {url(8001)}
        finally:
            await discovery.stop()


async def test_a_certificate_the_ca_does_not_verify_settles_the_pool_empty(tmp_path: Path) -> None:
    """A wrong CA bundle is not healed by waiting: readiness stops waiting for the first list at
    once (no `first_list_wait_s` to sit through), and the watcher goes on trying, reading the
    bundle again each time, so a fixed one fills the pool without a restart."""
    async with _in_cluster_api() as (api, port):
        api.put(make_pod("a", port=8001))
        sa = _service_account(tmp_path, Path(certifi.where()))  # public CAs: none signed the fake's
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
        config = KubernetesDiscoveryConfig(selector="app=vllm", port="http")
        watcher = PodWatcher(config, environ=env, sa_dir=sa, backoff_initial_s=0.02, backoff_max_s=0.05)
        errors: list[str] = []
        discovery = Discovery(watcher, on_error=errors.append, first_wait_s=0.0)
        await discovery.start(lambda change: None)
        try:
            await wait_until(lambda: discovery.settled)
            assert errors and set(errors) == {"list"} and discovery.current == frozenset()
            assert "Certificate" in (discovery.status().last_error or "")
            await wait_until(lambda: len(errors) >= 3)  # still trying
            # The bundle fixed in place (a Secret updated): read again, the pool fills.
            shutil.copy(TLS / "ca.crt", sa / "ca.crt")
            await wait_until(lambda: discovery.current == frozenset({url(8001)}), what="the pool filled")
        finally:
            await discovery.stop()


async def test_a_first_list_that_never_comes_settles_the_pool_after_first_list_wait_s(
    fake: FakeKubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An api_server that answers what is not the Kubernetes API (or stays unreachable) may be
    fixed by waiting, so readiness waits, but for `first_list_wait_s` only: then the pool is
    settled empty, once, with a log line, and fills when a list comes."""
    now_s = [100.0]
    fake.put(make_pod("a", port=8001))
    fake.list_garbage = b"<html>a proxy's login page</html>"
    async with follow(fake, tmp_path, first_list_wait_s=60.0, clock=lambda: now_s[0]) as f:
        await wait_until(lambda: fake.lists >= 3)
        assert not f.discovery.settled and set(f.errors) == {"list"}
        assert "ProtocolError" in (f.discovery.status().last_error or "")
        now_s[0] += 60.0
        await wait_until(lambda: f.discovery.settled)
        lists = fake.lists
        await wait_until(lambda: fake.lists >= lists + 2)  # still trying
        gave_up = [r for r in caplog.records if "readiness stops waiting" in r.getMessage()]
        assert len(gave_up) == 1 and "app=vllm" in gave_up[0].getMessage()
        assert f.current == frozenset()
        fake.list_garbage = None
        await f.routed(8001)


async def test_what_waiting_cannot_fix_stops_the_start(tmp_path: Path) -> None:
    config = KubernetesDiscoveryConfig(selector="app=vllm", port=8000)
    with pytest.raises(KubernetesSetupError, match="KUBERNETES_SERVICE_HOST"):
        await Discovery(PodWatcher(config, environ={}, sa_dir=tmp_path)).start(lambda c: None)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
    with pytest.raises(KubernetesSetupError, match=r"kubernetes\.namespace"):
        await Discovery(PodWatcher(config, environ=env, sa_dir=tmp_path)).start(lambda c: None)
    (tmp_path / "namespace").write_text("llm")
    with pytest.raises(KubernetesSetupError, match="token file"):
        await Discovery(PodWatcher(config, environ=env, sa_dir=tmp_path)).start(lambda c: None)


async def test_an_api_server_that_is_down_at_start_is_retried(tmp_path: Path) -> None:
    port = free_port()
    api = FakeKubeApi(token="tok-1")
    api.port = port  # not listening yet
    api.put(make_pod("a", port=8001))
    async with follow(api, tmp_path) as f:
        assert f.current == frozenset() and "list" in f.errors  # start() did not hang
        await api.start(port)
        try:
            await wait_until(lambda: f.current == {url(8001)})
        finally:
            await api.stop()


async def test_the_gateway_routes_to_ready_pods_and_reports_discovery_metrics(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    workers = [await serve_health_only() for _ in range(2)]
    ports = [port for _, port in workers]
    (tmp_path / "token").write_text("tok-1")
    decode = {"app": "vllm", "kvgate.io/role": "decode"}
    fake.put(make_pod("a", port=ports[0], labels=decode, annotations={"kvgate.io/kv": "5557"}))
    fake.put(make_pod("b", port=ports[1]))
    k8s = {
        "namespace": "llm",
        "selector": {"app": "vllm"},
        "port": "http",
        "role_label": "kvgate.io/role",
        "kv_events_annotation": "kvgate.io/kv",
        "api_server": fake.url,
        "token_file": str(tmp_path / "token"),
    }
    raw = {
        "pools": [{"name": "p", "models": ["m"], "kubernetes": k8s, "health": {"interval_s": 0.2}}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(raw, make_policy("round_robin"), secret=b"k") as gw:
            state, pool = gw.state, gw.state.registry.pools["p"]

            def routed() -> set[str]:
                return {w.url for w in pool.workers.values() if w.view(time.monotonic()).healthy}

            await wait_until(lambda: routed() == {url(p) for p in ports})
            a, b = WorkerId(url(ports[0])), WorkerId(url(ports[1]))
            assert pool.workers[a].role == "decode" and pool.workers[b].role is None
            assert state.fleet is not None and state.fleet.kv_events is not None
            kv = state.fleet.kv_events
            assert set(kv.stream_stats(a)) == {"tcp://127.0.0.1:5557"} and b not in kv.workers()
            prefill = {**decode, "kvgate.io/role": "prefill"}
            fake.put(make_pod("a", port=ports[0], labels=prefill, annotations={"kvgate.io/kv": "5558"}))
            await wait_until(lambda: pool.workers[a].role == "prefill")
            assert set(kv.stream_stats(a)) == {"tcp://127.0.0.1:5558"}  # followed where it moved
            fake.ready("b", False)
            await wait_until(lambda: routed() == {url(ports[0])})
            await wait_until(lambda: bool(fake.watchers))
            fake.expire()
            await wait_until(lambda: fake.lists == 2)
            text = state.routing.metrics.render().decode()
            assert 'kvgate_discovery_workers{pool="p"} 1.0' in text
            assert 'kvgate_discovery_resyncs_total{pool="p"} 1.0' in text
            assert 'kvgate_discovery_errors_total{pool="p",reason="expired"} 1.0' in text
        await wait_until(lambda: not fake.watchers)  # the lifespan's end closed the watch
    finally:
        for runner, _ in workers:
            await runner.cleanup()


async def test_a_pool_whose_first_list_fails_reports_no_workers(tmp_path: Path) -> None:
    # An API server that is not there: the pool stays empty, and its discovery gauge says 0 (the
    # chart's no-worker alert reads it) rather than being absent.
    (tmp_path / "token").write_text("tok-1")
    k8s = {
        "namespace": "llm",
        "selector": {"app": "vllm"},
        "port": "http",
        "api_server": f"http://127.0.0.1:{free_port()}",
        "token_file": str(tmp_path / "token"),
    }
    raw = {
        "pools": [{"name": "p", "models": ["m"], "kubernetes": k8s}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(raw, make_policy("round_robin"), secret=b"k", workers_up=False) as gw:
        text = gw.state.routing.metrics.render().decode()
        assert 'kvgate_discovery_workers{pool="p"} 0.0' in text
        assert 'kvgate_discovery_errors_total{pool="p",reason="list"}' in text
