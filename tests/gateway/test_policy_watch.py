"""Policy hot reload on a real file: swaps, no-op touches, bad files that keep the running policy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.policy_watch import MAX_POLICY_FILE_BYTES, LoadedPolicy, PolicyWatcher
from policies.config import PolicyConfigError


class Swaps:
    def __init__(self) -> None:
        self.loaded: list[LoadedPolicy] = []
        self.event = asyncio.Event()
        self.fail = False

    def __call__(self, loaded: LoadedPolicy) -> None:
        if self.fail:
            raise RuntimeError("gateway refused")
        self.loaded.append(loaded)
        self.event.set()


def write(path: Path, text: str) -> None:
    # Rename over the file like a ConfigMap update, and bump mtime so equal-size edits are seen.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


async def test_change_swaps_and_touch_does_not(policy_file: Path) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    first = w.load_initial()
    assert first.policy.name == "round_robin" and w.status().policy == "round_robin"
    assert await w.check() is None  # nothing moved

    write(policy_file, "policy: least_load\nseed: 2\n")
    result = await w.check()
    assert result is not None and result.swapped
    assert [s.policy.name for s in swaps.loaded] == ["least_load"]
    assert swaps.loaded[0].config.seed == 2
    assert w.status().reloads == 1 and w.status().sha256 == swaps.loaded[0].sha256

    write(policy_file, "policy: least_load\nseed: 2\n")  # same content, new stat
    result = await w.check()
    assert result is not None and result.unchanged and len(swaps.loaded) == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("policy: [\n", "YAML"),
        ("policy: round_robin\nsed: 1\n", "sed"),
        ("policy: no_such_policy\n", "no_such_policy"),
        (
            "policy: least_load\ncost:\n  epsilon: 0.5\n  epsilon: 0.7\n",
            "duplicate key 'cost.epsilon' on line 4",
        ),
    ],
)
async def test_bad_file_keeps_running_policy_and_says_why(policy_file: Path, text: str, needle: str) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    write(policy_file, text)
    result = await w.check()
    assert result is not None and not result.swapped and result.error is not None
    assert needle in result.error
    status = w.status()
    assert status.policy == "round_robin" and status.failures == 1 and status.last_error == result.error
    assert swaps.loaded == []

    write(policy_file, "policy: least_load\n")  # fixed: the next check swaps and clears the error
    fixed = await w.check()
    assert fixed is not None and fixed.swapped and w.status().last_error is None


@pytest.mark.parametrize("text", ["", "   \n\t\n"])
async def test_empty_file_is_refused_not_read_as_defaults(policy_file: Path, text: str) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, settle_s=0)  # an empty file waits to settle: none here
    w.load_initial()
    write(policy_file, text)
    result = await w.check()
    assert result is not None and not result.swapped and result.error is not None
    assert "empty" in result.error
    assert w.status().policy == "round_robin" and w.status().failures == 1 and swaps.loaded == []
    forced = await w.reload_now(force=True)
    assert forced.error is not None and "empty" in forced.error and swaps.loaded == []
    with pytest.raises(PolicyConfigError, match="empty"):
        PolicyWatcher(policy_file, Swaps()).load_initial()


async def test_reverting_a_bad_edit_clears_the_error(policy_file: Path) -> None:
    w = PolicyWatcher(policy_file, Swaps())
    w.load_initial()
    write(policy_file, "nonsense: 1\n")
    await w.check()
    write(policy_file, "policy: round_robin\nseed: 1\n")
    result = await w.check()
    assert result is not None and result.unchanged and w.status().last_error is None


async def test_missing_oversized_and_refused(policy_file: Path, tmp_path: Path) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    os.unlink(policy_file)
    result = await w.check()
    assert result is not None and result.error is not None and "stat" in result.error

    write(policy_file, "#" * (MAX_POLICY_FILE_BYTES + 1))
    result = await w.reload_now()
    assert result.error is not None and "larger" in result.error

    write(policy_file, "policy: least_load\n")
    swaps.fail = True
    result = await w.reload_now()
    assert result.error is not None and "gateway refused" in result.error
    assert w.status().policy == "round_robin" and w.status().failures == 3


async def test_initial_load_fails_loudly(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("policy: 3: 4\n")
    with pytest.raises(PolicyConfigError, match=r"p\.yaml"):
        PolicyWatcher(p, Swaps()).load_initial()
    with pytest.raises(OSError):
        PolicyWatcher(tmp_path / "absent.yaml", Swaps()).load_initial()


async def test_reload_now_force_rebuilds_same_content(policy_file: Path) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps)
    w.load_initial()
    assert (await w.reload_now()).unchanged
    forced = await w.reload_now(force=True)
    assert forced.swapped and len(swaps.loaded) == 1


async def test_a_manual_reload_counts_as_a_check(policy_file: Path) -> None:
    """`/admin/status` says when the file was last looked at: a reload asked for by an operator
    looks at it too, whether or not its content changed."""
    w = PolicyWatcher(policy_file, Swaps())
    w.load_initial()
    assert w.status().last_checked_at_unix_s is None
    assert (await w.reload_now()).unchanged
    first = w.status().last_checked_at_unix_s
    assert first is not None
    write(policy_file, "policy: round_robin\n")
    assert (await w.reload_now()).swapped
    second = w.status().last_checked_at_unix_s
    assert second is not None and second >= first


async def test_background_polling_picks_up_a_change(policy_file: Path) -> None:
    swaps = Swaps()
    w = PolicyWatcher(policy_file, swaps, interval_s=0.1)
    w.load_initial()
    await w.start()
    try:
        write(policy_file, "policy: least_load\n")
        async with asyncio.timeout(5):
            await swaps.event.wait()
        assert swaps.loaded[0].policy.name == "least_load"
        assert w.status().last_checked_at_unix_s is not None
    finally:
        await w.stop()


async def test_relative_normalizer_paths_are_read_beside_the_policy_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    path = folder / "policy.yaml"
    path.write_text(
        "policy: cost\nnormalizer: {tokenizer_dir: models/tok, chat_template_file: /abs/t.jinja}\n"
    )
    monkeypatch.chdir(tmp_path)  # started from elsewhere: the file's folder counts, not this one
    swaps = Swaps()
    w = PolicyWatcher(path, swaps)
    normalizer = w.load_initial().config.normalizer
    assert normalizer.tokenizer_dir == str(folder / "models/tok")
    assert normalizer.chat_template_file == "/abs/t.jinja"  # absolute: as written

    write(path, "policy: cost\nnormalizer: {tokenizer_dir: other}\n")
    result = await w.check()
    assert result is not None and result.swapped
    assert swaps.loaded[0].config.normalizer.tokenizer_dir == str(folder / "other")
