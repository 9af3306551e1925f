"""The load search: coarse geometric steps from a start load to a bracket, then bisection.

    r = start; pass(r)? step up by f until a load fails : step down by f until one passes
    (bounded by [lo_bound, hi_bound]); then while hi / lo > 1 + tol: m = sqrt(lo * hi), keep the
    half whose ends still pass / fail.

The capacity is the highest load seen to pass below the lowest load seen to fail, so it is never
above a failing measurement. Bisection assumes attainment falls as the load rises; a trace whose
attainment is not monotone in the load can have several crossings, and the search reports one of
them. `passes` is called at most once per load (the caller memoizes it across searches as well).
The load is a rate scale, or a number of users (`round_users`: whole users, so the bisection ends
when the bracket is one user wide if the tolerance has not ended it before).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """Where the search starts, its bounds, the coarse step factor and the relative tolerance."""

    start: float
    lo_bound: float
    hi_bound: float
    coarse_factor: float = 2.0
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.lo_bound <= self.start <= self.hi_bound:
            raise ValueError("need 0 < lo_bound <= start <= hi_bound")
        if self.coarse_factor <= 1 or self.tolerance <= 0:
            raise ValueError("coarse_factor must exceed 1 and tolerance be positive")


@dataclass(frozen=True, slots=True)
class Capacity:
    """The bracket the search ended with, in the search's load (a rate scale, or users).

    `load` is the highest passing load (None: even `lo_bound` failed); `failing_load` the lowest
    failing load above it (None: `hi_bound` passed, so the capacity is at least that).
    """

    load: float | None
    failing_load: float | None


def round_rate(rate: float) -> float:
    """Rates are kept to 6 significant digits, so a memo or a resumed run finds them again."""
    return float(f"{rate:.6g}")


def round_users(users: float) -> float:
    """Users are whole (at least one), halves rounded up."""
    return float(max(1, math.floor(users + 0.5)))


def find_capacity(
    passes: Callable[[float], bool],
    s: SearchSettings,
    rounding: Callable[[float], float] = round_rate,
    unit: float = 0.0,
) -> Capacity:
    """Bracket then bisect the highest load at which `passes` holds (see the module doc); every
    load tried is `rounding` of the step or midpoint. A coarse step moves by at least `unit`
    (one user: a small factor on a few users would round back onto the load it left)."""
    f = s.coarse_factor
    lo: float | None = None
    hi: float | None = None
    start = rounding(s.start)
    if passes(start):
        lo = start
        while hi is None:
            nxt = rounding(min(max(lo * f, lo + unit), s.hi_bound))
            if nxt <= lo:
                return Capacity(lo, None)
            if passes(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi = start
        while lo is None:
            nxt = rounding(max(min(hi / f, hi - unit), s.lo_bound))
            if nxt >= hi:
                return Capacity(None, hi)
            if passes(nxt):
                lo = nxt
            else:
                hi = nxt
    while hi / lo > 1 + s.tolerance:
        mid = rounding(math.sqrt(lo * hi))
        if mid <= lo or mid >= hi:  # rounding ate the gap
            break
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, hi)
