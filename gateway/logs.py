"""Structured JSON logs: one object per line on stderr. Prompt text never reaches a log record."""

from __future__ import annotations

import logging
import sys
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


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvgate")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
