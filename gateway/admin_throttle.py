"""Wrong admin keys, counted per client address: past a few in a window, the address's admin
requests are refused (429) without their key being checked until the window passes.

The admin API is served on the client port, and an admin key may be one an operator chose rather
than a long random one: without this, anyone who reaches the port could try keys as fast as the
gateway answers. Per address (an IPv6 address by its /64, which one host usually holds whole):

    on a wrong admin key:  window passed or none -> new window (now, 1 failure)
                           else                   -> failures += 1
    on any admin request:  failures >= limit within the window -> 429, Retry-After = window end - now

A right key resets nothing: an operator behind the same address as a guesser (an ingress, a NAT)
would otherwise hand the guesser a fresh budget, and a throttled address cannot prove it holds
the key without its key being checked. The table is bounded (`max_addresses`): windows that have
passed are dropped, a live one never is (dropping it would hand its address a fresh budget), and
while the table is full of live windows every address not in it counts under one shared window,
`OVERFLOW`: spraying addresses costs no memory and buys no more than one more budget a window.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# An operator mistyping a key a few times never meets it; a guesser gets 10 keys a minute per
# address (14,400 a day), which still asks for an admin key too long to guess at that rate.
MAX_FAILURES = 10
WINDOW_S = 60.0
MAX_ADDRESSES = 4096
# Where every address not in a full table of live windows counts (no address is written so).
OVERFLOW = "*"
_IPV6_PREFIX_BITS = 64
# IPv6 addresses that carry an IPv4 one: RFC 6052's well-known NAT64 prefix (its clients are
# IPv4 hosts, counted as such rather than all under one /64).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True, slots=True)
class Throttled:
    """An address refused until its window ends, `retry_after_s` from now (whole seconds, at
    least 1, for the `Retry-After` header)."""

    retry_after_s: int


@dataclass(slots=True)
class _Window:
    start_s: float
    failures: int


class AdminAuthThrottle:
    """Wrong admin keys per client address in fixed windows that begin at an address's first
    wrong key (module doc). Invariant: `_windows` is ordered by `start_s` (a window that restarts
    moves to the end, on a monotonic clock) and holds at most `max_addresses` entries."""

    def __init__(
        self,
        max_failures: int = MAX_FAILURES,
        window_s: float = WINDOW_S,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def __len__(self) -> int:
        return len(self._windows)

    def refusal(self, address: str) -> Throttled | None:
        """`Throttled` while `address` has used up its window's wrong keys; None otherwise (then
        the caller checks the key)."""
        window = self._windows.get(address)
        if window is None:
            if not self._full(self.clock()):
                return None
            address, window = OVERFLOW, self._windows.get(OVERFLOW)
            if window is None:
                return None
        left_s = window.start_s + self.window_s - self.clock()
        if left_s <= 0:
            del self._windows[address]  # its window passed: nothing to remember
            return None
        if window.failures < self.max_failures:
            return None
        return Throttled(max(1, math.ceil(left_s)))

    def failed(self, address: str) -> bool:
        """Count a wrong admin key from `address`; True when this one used up its window (the
        address is refused from now on, until the window ends)."""
        now_s = self.clock()
        window = self._windows.get(address)
        if window is not None and now_s - window.start_s < self.window_s:
            window.failures += 1
            return window.failures == self.max_failures
        if window is not None:
            del self._windows[address]  # restarts at the end, keeping the order by start
        if self._full(now_s) and address != OVERFLOW:
            return self.failed(OVERFLOW)
        self._windows[address] = _Window(now_s, 1)
        return self.max_failures == 1

    def _full(self, now_s: float) -> bool:
        """Whether the table is full of live windows, once the passed ones are dropped from the
        front (each entry is dropped once: O(1) per call amortised). One place is kept for
        `OVERFLOW`, so that it always has one."""
        windows = self._windows
        while windows and now_s - next(iter(windows.values())).start_s >= self.window_s:
            windows.popitem(last=False)
        return len(windows) >= self.max_addresses - (OVERFLOW not in windows)

    def check_invariants(self) -> None:
        starts = [w.start_s for w in self._windows.values()]
        assert starts == sorted(starts), "windows out of order"
        assert len(self._windows) <= self.max_addresses, "table past its bound"
        assert all(w.failures >= 1 for w in self._windows.values())


def address_key(host: str | None) -> str:
    """What the throttle counts under for a client address: an IPv6 address by its /64 (an
    IPv4-mapped one, or one under the NAT64 prefix, as its IPv4 address), any other as sent; no
    address (a Unix socket) as ""."""
    if not host:
        return ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if ip in _NAT64:
            return str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return str(ipaddress.IPv6Network((ip, _IPV6_PREFIX_BITS), strict=False))
    return host
