"""Structured JSON logs: one object per line on stderr. Prompt text never reaches a log record."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import orjson

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """Renders `logging` records as one JSON object with the record's `extra` fields inlined."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


# What `log_level` and `--log-level` take, in any case (the names `logging` knows, less its aliases).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def setup_logging(level: str = "info") -> None:
    """Every log line of the process as one JSON object on stderr: one handler, on the root
    logger, writes kvgate's records at `level` and above and every other logger's (the
    OpenTelemetry SDK's exporter, uvicorn's, asyncio's, Python's warnings) at warning and above,
    or at `level` when that is higher: the libraries' info and debug chatter stays out. Called
    again (the config's level after the flag's), it replaces what it set.

    A logger given handlers of its own that does not propagate writes past this handler: uvicorn's
    default log config gives its loggers plain-text ones, which `log_config=None` keeps off."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.WARNING, logging.getLevelNamesMapping()[level.upper()]))
    kvgate = logging.getLogger("kvgate")
    kvgate.handlers.clear()  # its records go through the root's handler, once
    kvgate.setLevel(level.upper())
    kvgate.propagate = True
    logging.captureWarnings(True)


class AccessLog:
    """One JSON line per finished request, in the same shape as the other logs.

    The access line is the only log on the hot path, so it skips `logging`'s record machinery and
    the per-line flush of stderr: lines collect in a bounded buffer that the app lifespan flushes
    every `flush_interval_s` (and at shutdown); a full buffer is flushed inline.
    """

    flush_interval_s = 0.2
    _max_lines = 512

    def __init__(self, fd: int | None = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self._fd = sys.stderr.fileno() if fd is None else fd
        self._lines: list[bytes] = []

    def write(self, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {
            "ts": round(time.time(), 3),
            "level": "info",
            "logger": "kvgate.access",
            "msg": "request",
            **fields,
        }
        self._lines.append(orjson.dumps(record, default=str) + b"\n")
        if len(self._lines) >= self._max_lines:
            self.flush()

    def flush(self) -> None:
        write_lines(self._fd, self._lines)


def write_lines(fd: int, lines: list[bytes]) -> None:
    """Write and clear buffered JSON lines. A sink that cannot keep up (or a full disk) loses
    lines, never blocks requests."""
    if not lines:
        return
    data = b"".join(lines)
    lines.clear()
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # BlockingIOError included
        pass
