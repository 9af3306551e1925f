"""When a peer's batch was decided, on this gateway's monotonic clock, and how late it came.

A batch carries its sender's wall-clock send time. Across hosts its age by the wall clocks
includes their skew, which may be large either way; the skew is the same for every batch of one
origin, so the age counted is the excess over the origin's smallest recent age (a real transit of
tens of microseconds is lost on one host, and no skew is counted across hosts).

That smallest age is learned from the batches themselves, and whoever replays captured batches
chooses which come first: the first batch of a sender heard for the first time (by a gateway that
just started) sets it, so replayed batches, oldest first, all read as on time. How late a batch is
for its quota charges (`late_s`) is therefore its age by the wall clocks alone, beyond
`ON_TIME_S`: a replay can only make a batch older, and clocks kept by NTP are far closer than that.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.sync.codec import SyncBatch

# How fast an origin's smallest batch age may rise again (s per s): far faster than clocks drift
# apart. A step of either clock is forgotten faster still: the smallest age also rises toward a
# batch's age with this time constant (s), so that any step within `MAX_CLOCK_SKEW_S` is within
# the herd's 1 s horizon in a minute and gone in two (at 10 ms a second, a 60 s step took an hour
# and a half). A batch's lag of up to about 100 ms still rises the floor at the drift, and a lag
# only ever reads shorter for it.
AGE_FLOOR_DRIFT = 1e-2
AGE_FLOOR_STEP_S = 8.0
_MAX_ORIGINS = 4096  # bounded against churning peers
# How old a batch may be, by the wall clocks, and still be on time for its quota charges: the skew
# of clocks kept by NTP (milliseconds) and a broker's delivery, with room to spare. Clocks further
# apart make a peer's charges count less here (`rate_buckets.late_weight`), and show as
# `late_quota_rows`.
ON_TIME_S = 2.0


def late_s(batch: SyncBatch, wall_s: float) -> float:
    """How much later than `ON_TIME_S` after its send time the batch arrived at wall clock
    `wall_s` (0 if not later)."""
    return max(0.0, wall_s - batch.sent_wall_s - ON_TIME_S)


class BatchAges:
    """Each origin's smallest recent batch age, and what it makes of a batch's decision time."""

    def __init__(self) -> None:
        self._floor: dict[str, tuple[float, float]] = {}  # origin -> (smallest age, when)

    def decided_s(self, batch: SyncBatch, now_s: float, wall_s: float) -> float:
        """The earliest the batch's items can have been decided, on the monotonic clock of
        `now_s` (`wall_s`: the wall clock at the same moment): its age beyond its origin's
        smallest, plus how long its first item waited in the sender's queue."""
        age = wall_s - batch.sent_wall_s
        floors = self._floor
        found = floors.get(batch.origin)
        if found is None:
            floor = age
        else:
            dt = now_s - found[1]
            step = (age - found[0]) * -math.expm1(-dt / AGE_FLOOR_STEP_S)
            floor = min(age, found[0] + max(AGE_FLOOR_DRIFT * dt, step))
        if len(floors) >= _MAX_ORIGINS and batch.origin not in floors:
            floors.clear()
        floors[batch.origin] = (floor, now_s)
        return now_s - (age - floor) - batch.waited_s

    def keep(self, heard_from: Callable[[str], bool]) -> None:
        """Forget the origins `heard_from` no longer knows."""
        for origin in [o for o in self._floor if not heard_from(o)]:
            del self._floor[origin]
