"""The process's `logging` setup as a test found it, given back after a test that calls
`setup_logging` (which sets the root and `kvgate` loggers and captures Python's warnings): else
every later test in this process logs at that test's level, to a stderr captured for it only."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def logging_restored(*names: str) -> Iterator[None]:
    """Give back the root logger, `kvgate` and the loggers `names` as found, and `warnings`'
    `showwarning`, when the block ends."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in ("kvgate", *names))]
    saved = [(x.handlers[:], x.level, x.propagate) for x in loggers]
    showwarning = warnings.showwarning
    try:
        yield
    finally:
        logging.captureWarnings(False)
        warnings.showwarning = showwarning
        for logger, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
