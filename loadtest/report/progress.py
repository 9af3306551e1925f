"""A minimal text progress bar on stderr (no dependency), redrawn at most every `min_interval_s`."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`update(done)` redraws `label [#####.....] done/total`; `close()` ends the line."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        width: int = 30,
        min_interval_s: float = 0.2,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self._last_draw = 0.0
        self._started = time.monotonic()
        self._done = 0

    def update(self, done: int) -> None:
        self._done = done
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval_s or done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self._done / self.total, 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._started
        self.stream.write(f"\r{self.label} [{bar}] {self._done}/{self.total} {elapsed:6.1f}s")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
