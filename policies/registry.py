"""Name → policy class registry, filled by the `register_policy` decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from policies.base import RoutingPolicy


class PolicyFactory(Protocol):
    name: str

    def __call__(self, *, seed: int = 0, **options: Any) -> RoutingPolicy: ...


_REGISTRY: dict[str, Callable[..., RoutingPolicy]] = {}

T = TypeVar("T")


def register_policy(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make the class constructible by `make_policy(name, ...)`."""

    def wrap(cls: type[T]) -> type[T]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name  # type: ignore[attr-defined]
        _REGISTRY[name] = cls  # type: ignore[assignment]
        return cls

    return wrap


def known_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, *, seed: int = 0, **options: Any) -> RoutingPolicy:
    """Build a registered policy; an unknown name fails with the list of known ones."""
    _load_builtin()
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return cls(seed=seed, **options)


def _load_builtin() -> None:
    # Importing the modules runs their decorators.
    import policies.baselines
    import policies.cost_policy
    import policies.preble
    import policies.sglang_cache_aware  # noqa: F401
