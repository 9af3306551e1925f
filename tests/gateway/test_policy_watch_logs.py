"""Each rejected content of the policy file is logged once: a second bad edit is logged even when
its error reads like the first's, and no content is logged again however often it is polled or
reloaded by hand."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.policy_watch import PolicyWatcher
from tests.gateway.test_policy_watch import Swaps, write


class _Rejections(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("policy reload rejected"):
            self.lines.append(record.getMessage())


@pytest.fixture
def rejections() -> Iterator[_Rejections]:
    # On the module's own logger and at its level: another test's logging set-up may have stopped
    # it propagating, or left the root above error.
    handler, logger = _Rejections(), logging.getLogger("kvgate.policy_watch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_each_rejected_content_is_logged_once(policy_file: Path, rejections: _Rejections) -> None:
    w = PolicyWatcher(policy_file, Swaps())
    w.load_initial()

    write(policy_file, "policy: no_such_policy\n")
    first = await w.check()
    assert first is not None and first.error is not None
    assert await w.check() is None  # polled again: nothing new
    assert (await w.reload_now()).error == first.error  # by hand: the same content, not logged again
    assert len(rejections.lines) == 1

    # Another bad edit whose error is word for word the first's: a new content, logged.
    write(policy_file, "policy: no_such_policy\nseed: 5\n")
    second = await w.check()
    assert second is not None and second.error == first.error
    assert len(rejections.lines) == 2
    assert (await w.reload_now()).error == first.error and len(rejections.lines) == 2

    # Fixed, then broken the same way again: that is news again.
    write(policy_file, "policy: least_load\n")
    fixed = await w.check()
    assert fixed is not None and fixed.swapped
    write(policy_file, "policy: no_such_policy\n")
    again = await w.check()
    assert again is not None and again.error is not None
    assert len(rejections.lines) == 3
    assert all("no_such_policy" in line for line in rejections.lines)


async def test_a_missing_file_is_logged_once(policy_file: Path, rejections: _Rejections) -> None:
    w = PolicyWatcher(policy_file, Swaps())
    w.load_initial()
    os.unlink(policy_file)
    assert (await w.check()) is not None
    assert await w.check() is None
    assert (await w.reload_now()).error is not None
    assert len(rejections.lines) == 1 and "stat" in rejections.lines[0]
