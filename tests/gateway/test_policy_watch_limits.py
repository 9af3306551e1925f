"""Policy reload under hostile or heavy files: alias bombs, bad files seen by many polls, and a
slow build that must leave the event loop free."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from gateway import policy_watch
from gateway.policy_watch import MAX_POLICY_FILE_BYTES, LoadedPolicy, PolicyWatcher
from policies.config import PolicyConfigError
from tests.gateway.test_policy_watch import Swaps, write


def alias_bomb(levels: int) -> str:
    """Each level a list of ten aliases of the level below: a few hundred bytes that expand to
    10^levels values."""
    rows = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, levels))
    return "policy: cost\nl0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + rows


def write_bytes(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


async def test_an_alias_bomb_is_refused_before_it_is_built_and_the_old_policy_stays(
    policy_file: Path,
) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    write(policy_file, alias_bomb(levels=12))  # 10^12 values if built
    result = await w.check()
    assert result is not None and result.error is not None and not result.swapped
    assert "expands to more than 1,000,000 values" in result.error
    assert w.status().policy == "round_robin" and swaps.loaded == []


@pytest.mark.parametrize(
    "content",
    [
        b"#" * (MAX_POLICY_FILE_BYTES + 1),
        b"policy: \xff\xfe\n",
        b"policy: [\n",
        alias_bomb(levels=8).encode(),
        b"policy: round_robin\nsed: 1\n",
        b"",
    ],
    ids=["oversized", "not-utf8", "bad-yaml", "alias-bomb", "unknown-key", "empty"],
)
async def test_a_bad_file_counts_once_however_often_it_is_polled(policy_file: Path, content: bytes) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0)  # written in place: no wait to settle here
    w.load_initial()
    write_bytes(policy_file, content)
    first = await w.check()
    assert first is not None and first.error is not None
    for _ in range(5):
        assert await w.check() is None
    assert w.status().failures == 1 and w.status().last_error == first.error

    # Changed but still bad: tried again, counted again.
    write_bytes(policy_file, content + b" ")
    again = await w.check()
    assert again is not None and again.error is not None
    assert await w.check() is None and w.status().failures == 2

    # A valid file after the bad ones swaps and clears the error.
    write(policy_file, "policy: least_load\n")
    fixed = await w.check()
    assert fixed is not None and fixed.swapped and [s.policy.name for s in swaps.loaded] == ["least_load"]
    assert w.status().last_error is None and w.status().failures == 2


async def test_a_missing_file_counts_once_and_its_return_is_loaded(policy_file: Path) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    os.unlink(policy_file)
    first = await w.check()
    assert first is not None and first.error is not None and "stat" in first.error
    assert await w.check() is None and await w.check() is None
    assert w.status().failures == 1
    write(policy_file, "policy: least_load\n")
    back = await w.check()
    assert back is not None and back.swapped


async def test_the_build_runs_off_the_event_loop(policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build blocks until a callback that only the event loop can run releases it.

    Were the build on the loop, the callback could not run and the build would give up (after a
    bound that only keeps a regression from hanging the suite) and fail the reload.
    """
    loop = asyncio.get_running_loop()
    building = asyncio.Event()
    released = threading.Event()
    build_threads: list[int] = []
    real_load = policy_watch.load_policy_text

    def slow_load(text: str, base: Path | None = None) -> LoadedPolicy:
        build_threads.append(threading.get_ident())
        loop.call_soon_threadsafe(building.set)
        if not released.wait(timeout=30):
            raise PolicyConfigError("the event loop did not run during the build")
        return real_load(text, base)

    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    monkeypatch.setattr(policy_watch, "load_policy_text", slow_load)
    write(policy_file, "policy: least_load\n")

    async def release_once_building() -> None:
        await building.wait()
        loop.call_soon(released.set)

    releaser = asyncio.create_task(release_once_building())
    result = await w.check()
    await releaser
    assert result is not None and result.swapped, result
    assert build_threads[-1] != threading.get_ident()
    assert [s.policy.name for s in swaps.loaded] == ["least_load"]
