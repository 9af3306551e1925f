"""Warnings that something outside the gateway can repeat at will (a worker's malformed KV-event
messages, a publisher's sequence jumps) are written at most once per interval and key, with how
many of the same were left unwritten since: a storm of them costs a counter each, not a log line
each."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping


class LogThrottle:
    """At most one line per `every_s` seconds for each key (e.g. (worker, kind)); the keys kept
    are bounded (`max_keys`: the key heard from least recently is forgotten first, so that at
    worst one of its lines comes early)."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0, max_keys: int = 4096) -> None:
        self._log = logger
        self.every_s = every_s
        self._max_keys = max_keys
        self._last: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # key -> (logged at, left)

    def warning(
        self,
        key: Hashable,
        now_s: float,
        message: str,
        *args: object,
        extra: Mapping[str, object] | None = None,
    ) -> bool:
        """Log `message % args` (with the record fields `extra`) at warning level unless `key` was
        logged less than `every_s` ago (then count it); a line written after others were left
        carries their number. True when written."""
        last = self._last.get(key)
        if last is not None and now_s - last[0] < self.every_s:
            self._last[key] = (last[0], last[1] + 1)
            self._last.move_to_end(key)  # heard from: the last to be forgotten
            return False
        left = 0 if last is None else last[1]
        self._last[key] = (now_s, 0)
        self._last.move_to_end(key)
        if len(self._last) > self._max_keys:
            self._last.popitem(last=False)
        if left:
            more = " (and %d more like it since the last such line)"
            self._log.warning(message + more, *args, left, extra=extra)
        else:
            self._log.warning(message, *args, extra=extra)
        return True
