"""Workloads by name, with `key=value` overrides of their keyword parameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from loadtest.workloads.generators import agent_sessions, generated_shared_prefix, rag, zipf_tenants
from loadtest.workloads.records import WorkloadRequest

Generator = Callable[..., list[WorkloadRequest]]

WORKLOADS: dict[str, Generator] = {
    "agent": agent_sessions,
    "rag": rag,
    "zipf": zipf_tenants,
    "gsp": generated_shared_prefix,
}


def _coerce(default: Any, text: str) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true/false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, tuple):
        parts = text.split(",")
        if len(parts) != len(default):
            raise ValueError(f"expected {len(default)} comma-separated values, got {text!r}")
        return tuple(type(d)(p) for d, p in zip(default, parts, strict=True))
    return type(default)(text)


def make_workload(name: str, seed: int = 0, overrides: Sequence[str] = ()) -> list[WorkloadRequest]:
    """Build workload `name` with `param=value` overrides; an unknown name fails with the known ones."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") from None
    params = inspect.signature(gen).parameters
    kwargs: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in params or key == "seed":
            known = ", ".join(p for p in params if p != "seed")
            raise ValueError(f"bad workload option {item!r} for {name}; options: {known}")
        try:
            kwargs[key] = _coerce(params[key].default, value)
        except ValueError as exc:
            raise ValueError(f"workload option {key}: {exc}") from None
    return gen(seed, **kwargs)
