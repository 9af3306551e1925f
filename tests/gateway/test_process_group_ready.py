"""`kvgate serve --processes N`: the probes ask process 0 alone, so its `/readyz` answers for the
pod and stays 503 until every other process is ready too (each says so with a file, which the
supervisor removes before it starts or restarts that process), or held down by the supervisor."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway import multiproc
from gateway.auth import hash_api_key
from gateway.lifecycle import PEERS_READY_ENV, READY_FILE_ENV, ProcessGroup, held_file
from gateway.multiproc import Children
from policies import make_policy
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.wait import wait_until, wait_until_sync


def _config() -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        "scrape": {"enabled": False},
    }


@contextlib.asynccontextmanager
async def _process_0(
    own: Path, peers: list[Path], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[InProcessGateway, Callable[[], Awaitable[tuple[int, dict[str, Any]]]]]]:
    """Process 0 of a group whose other processes' ready files are `peers`, and its `/readyz`."""
    monkeypatch.setenv(READY_FILE_ENV, str(own))
    monkeypatch.setenv(PEERS_READY_ENV, json.dumps([str(p) for p in peers]))
    async with gateway_in_process(_config(), make_policy("round_robin"), secret=b"k", workers_up=False) as gw:

        async def readyz() -> tuple[int, dict[str, Any]]:
            resp = await gw.client.get("/readyz")
            return resp.status_code, resp.json()

        yield gw, readyz


def test_the_group_is_read_from_the_environment(tmp_path: Path) -> None:
    assert ProcessGroup.from_env({}) == ProcessGroup()
    peers = json.dumps([str(tmp_path / "odd:dir" / "ready-1"), str(tmp_path / "ready-2")])
    group = ProcessGroup.from_env({READY_FILE_ENV: str(tmp_path / "ready-0"), PEERS_READY_ENV: peers})
    assert group.ready_file == tmp_path / "ready-0"
    assert group.peer_files == (tmp_path / "odd:dir" / "ready-1", tmp_path / "ready-2")  # any path
    assert group.peers_waiting() == 2
    (tmp_path / "ready-2").touch()
    assert group.peers_waiting() == 1


async def test_process_0_is_ready_once_every_other_process_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own, peers = tmp_path / "ready-0", [tmp_path / "ready-1", tmp_path / "ready-2"]
    async with _process_0(own, peers, monkeypatch) as (_, readyz):
        await wait_until(own.exists)  # itself ready: it says so, as every process does
        status, body = await readyz()
        assert status == 503 and body["reason"] == "waiting for 2 of 2 other gateway process(es)"
        peers[1].touch()
        status, body = await readyz()
        assert status == 503 and body["reason"] == "waiting for 1 of 2 other gateway process(es)"
        peers[0].touch()
        assert (await readyz())[0] == 200
        peers[1].unlink()  # the supervisor restarts process 2
        assert (await readyz())[0] == 503


def test_a_held_process_is_counted_apart_from_the_waiting(tmp_path: Path) -> None:
    peers = (tmp_path / "ready-1", tmp_path / "ready-2")
    group = ProcessGroup(peer_files=peers)
    held_file(peers[0]).touch()  # the supervisor holds process 1 down
    assert held_file(peers[0]) == tmp_path / "ready-1.held"
    assert (group.peers_waiting(), group.peers_held()) == (1, 1)
    held_file(peers[1]).touch()
    assert (group.peers_waiting(), group.peers_held()) == (0, 2)
    held_file(peers[0]).unlink()  # its hold ended: restarted, it is waited for again
    assert (group.peers_waiting(), group.peers_held()) == (1, 1)


async def test_process_0_is_ready_while_the_others_are_ready_or_held_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held process has no socket, so the kernel hands it no connection: the others serve, and
    the pod stays in service, its `/readyz` and `kvgate_processes_held` counting the held ones.
    It used to answer 503 for the whole hold (up to 10 minutes)."""
    own, peers = tmp_path / "ready-0", [tmp_path / "ready-1", tmp_path / "ready-2"]
    async with _process_0(own, peers, monkeypatch) as (gw, readyz):

        def gauge() -> str:
            lines = gw.state.routing.metrics.render().decode().splitlines()
            return next(line for line in lines if line.startswith("kvgate_processes_held "))

        await wait_until(own.exists)
        assert gauge() == "kvgate_processes_held 0.0"
        held_file(peers[0]).touch()  # process 1 held down; process 2 still starting
        status, body = await readyz()
        assert status == 503 and body == {
            "status": "starting",
            "reason": "waiting for 1 of 2 other gateway process(es)",
            "held": 1,
        }
        peers[1].touch()
        assert await readyz() == (200, {"status": "ready", "held": 1})
        assert gauge() == "kvgate_processes_held 1.0"
        peers[1].unlink()
        held_file(peers[1]).touch()  # every other process held: process 0 serves, so still ready
        assert await readyz() == (200, {"status": "ready", "held": 2})
        assert gauge() == "kvgate_processes_held 2.0"
        held_file(peers[0]).unlink()  # the supervisor restarts process 1: waited for again
        assert (await readyz())[0] == 503
        peers[0].touch()
        assert await readyz() == (200, {"status": "ready", "held": 1})


async def test_a_lone_process_is_ready_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(READY_FILE_ENV, raising=False)
    monkeypatch.delenv(PEERS_READY_ENV, raising=False)
    async with gateway_in_process(_config(), make_policy("round_robin"), secret=b"k", workers_up=False) as gw:
        await wait_until(lambda: gw.state.lifecycle.ready)
        assert (await gw.client.get("/readyz")).status_code == 200


def test_the_supervisor_tells_each_child_its_file_and_process_0_the_others(tmp_path: Path) -> None:
    ready_dir = tmp_path / "ready"
    ready_dir.mkdir()
    (ready_dir / "ready-1").touch()  # left by the child that ran before: not ready until it says so
    script = (
        "import json, os, sys\n"
        f"names = {[READY_FILE_ENV, PEERS_READY_ENV]!r}\n"
        "json.dump({n: os.environ.get(n) for n in names}, open(sys.argv[1] + '.tmp', 'w'))\n"
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
    )
    children = Children(
        [sys.executable, "-c", script],
        3,
        {},
        lambda i: [str(tmp_path / f"env-{i}.json")],
        ready_dir=ready_dir,
    )
    try:
        for i in range(3):
            children.start(i)
        assert not (ready_dir / "ready-1").exists()
        for i in range(3):
            wait_until_sync((tmp_path / f"env-{i}.json").exists)
        envs = [json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(3)]
        # Each exits once its file is written: a stop before that would SIGTERM it mid-exit.
        wait_until_sync(lambda: all(p is None or p.poll() is not None for p in children.procs))
    finally:
        assert children.stop(10.0) == 0
    assert [e[READY_FILE_ENV] for e in envs] == [str(ready_dir / f"ready-{i}") for i in range(3)]
    assert json.loads(envs[0][PEERS_READY_ENV]) == [str(ready_dir / "ready-1"), str(ready_dir / "ready-2")]
    assert envs[1][PEERS_READY_ENV] is None and envs[2][PEERS_READY_ENV] is None


def test_a_child_that_exited_is_not_ready_from_then_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ready file goes as soon as the supervisor sees it gone, not a restart later: process 0
    must not answer ready for a process the kernel can no longer hand connections to."""
    ready_dir = tmp_path / "ready"
    ready_dir.mkdir()
    ready = ready_dir / "ready-1"
    script = "import sys\nopen(sys.argv[1], 'w').close()\n"  # says it is ready, then exits
    children = Children([sys.executable, "-c", script], 2, {}, lambda i: [str(ready)], ready_dir=ready_dir)
    seen: list[bool] = []
    monkeypatch.setattr(multiproc.time, "sleep", lambda s: seen.append(ready.exists()))
    try:
        children.start(1)
        proc = children.procs[1]
        assert proc is not None
        proc.wait()
        assert ready.exists()
        assert children.watch()  # restarts it, after its pause
        again = children.procs[1]
        assert again is not None and again is not proc
        again.wait()
    finally:
        assert children.stop(10.0) == 0
    assert seen == [False]  # gone during the pause before the restart
