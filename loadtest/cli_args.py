"""Argument types the benchmark commands share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


class UsageError(ValueError):
    """A command-line value that cannot be used (the commands print it and exit 2)."""


def worker_split(text: str) -> tuple[int, int]:
    """`--pd P:D` as two worker counts, at least one of each."""
    try:
        n_prefill, n_decode = (int(part) for part in text.split(":"))
    except ValueError:
        raise UsageError(f"--pd takes P:D, two worker counts (e.g. 4:4), not {text!r}") from None
    if n_prefill < 1 or n_decode < 1:
        raise UsageError("--pd needs at least one prefill and one decode worker")
    return n_prefill, n_decode
