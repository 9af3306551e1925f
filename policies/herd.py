"""Synced gateways deciding at the same instant: how many peer decisions one cannot see, who takes what.

Gateways that share their decisions (`policies.peer_sync`) see each other's dispatches a sync lag
late. Requests that reach several gateways within that lag are routed on the same view, so a miss
from every gateway goes to the same least-loaded worker: the herd. One gateway would have routed
them one after the other, each seeing the last.

`UnseenPeers` measures how much of that happens. When a peer's dispatch arrives, the gateway counts
its own decisions made since the peer decided: none of them could see it. Those pairs, over the
gateway's own decisions (both decayed over `window_s`), give how many peer dispatches one decision
of this gateway typically cannot see. A steady stream gives about rate × lag (a small number for
any realistic rate and a lag of milliseconds); arrivals that come together, as a batch job's or a
trace's on a coarse clock, give about the size of what comes together. It counts coincidences:
a rate enters only through how many decisions fall within a lag of each other.

`UnseenPeers` also keeps the lag itself (from a peer's decision to its arrival here, the largest
of the last `LAG_SAMPLES` peer dispatches: idle time does not shorten it), and `hold_for` turns a
request's predicted prefill into how long a gateway in a burst holds it before deciding: one lag
per step reached (`hold_steps`). The cheap requests of an instant are placed first, and the
expensive ones, held, see where every gateway put them. A prompt of many seconds no longer lands
unseen on the worker where another gateway's short turn went the same instant (it would wait
behind it for all those seconds), and the short requests reach the engines' FCFS queues before it.

`home_workers` breaks the symmetry without a message: a convention every gateway computes alike,
the pool's workers sorted by id dealt in turn to the gateways sorted by name. A gateway that
expects unseen peers prefers its own share within a margin (`policies.cost_herd`), so the
gateways' same-instant choices part instead of piling up.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Sequence

from policies.base import WorkerId


class UnseenPeers:
    """Peer dispatches per own decision that the decision could not see (see the module docstring).

    Own decision times are kept for `horizon_s` (at most `MAX_OWN` of them): a peer dispatch
    arriving later than that after its decision counts only the decisions within the horizon.
    Times are one clock's (the receiver's); decisions are noted in non-decreasing time.
    """

    MAX_OWN = 4096
    LAG_SAMPLES = 64

    __slots__ = ("_at", "_decisions", "_lag_max", "_lags", "_own", "_pairs", "horizon_s", "window_s")

    def __init__(self, window_s: float = 30.0, horizon_s: float = 1.0) -> None:
        if window_s <= 0 or horizon_s <= 0:
            raise ValueError("window_s and horizon_s must be > 0")
        self.window_s = window_s
        self.horizon_s = horizon_s
        self._own: deque[float] = deque()
        self._pairs = 0.0
        self._decisions = 0.0
        self._at = 0.0
        self._lags: deque[float] = deque(maxlen=self.LAG_SAMPLES)  # the last peer dispatches' lags
        self._lag_max: float | None = 0.0  # max(_lags), None until recomputed

    def _decay(self, now_s: float) -> None:
        elapsed = now_s - self._at
        if elapsed > 0:
            keep = math.exp(-elapsed / self.window_s)
            self._pairs *= keep
            self._decisions *= keep
            self._at = now_s

    def own(self, now_s: float) -> None:
        """This gateway decided at `now_s`."""
        self._decay(now_s)
        self._decisions += 1.0
        own = self._own
        own.append(now_s)
        oldest = now_s - self.horizon_s
        while own[0] < oldest or len(own) > self.MAX_OWN:
            own.popleft()

    def peer(self, decided_s: float, now_s: float) -> None:
        """A peer's dispatch, decided no earlier than `decided_s`, arrives at `now_s`."""
        self._decay(now_s)
        lag = min(max(0.0, now_s - decided_s), self.horizon_s)
        lags = self._lags
        if len(lags) == lags.maxlen and lags[0] == self._lag_max:
            self._lag_max = None  # the largest is about to leave
        lags.append(lag)
        if self._lag_max is not None and lag > self._lag_max:
            self._lag_max = lag
        own = self._own
        if not own or own[-1] < decided_s:
            return
        self._pairs += len(own) - bisect_left(own, max(decided_s, now_s - self.horizon_s))

    @property
    def lag_s(self) -> float:
        """How late peers' dispatches arrive here: the largest lag of the last `LAG_SAMPLES` (a
        slow batch counts until that many more have come), each at most `horizon_s`; 0 before any."""
        if self._lag_max is None:
            self._lag_max = max(self._lags)
        return self._lag_max

    @property
    def per_decision(self) -> float:
        """Peer dispatches one decision of this gateway could not see, on average over the window
        (0 until it has decided)."""
        return self._pairs / self._decisions if self._decisions > 0.0 else 0.0


# A request's hold, in lags, is the number of these prefill times (seconds) it reaches.
HOLD_STEPS_S = (0.25, 1.0, 4.0)
# A hold never exceeds this share of the request's own prefill.
HOLD_MAX_SHARE = 1 / 16
# Past this lag, no hold: the broker is too slow for a hold to let peers' choices arrive.
HOLD_MAX_LAG_S = 0.1
# Added to the lag seen, so that what a peer decided a lag before has arrived when the hold ends.
HOLD_MARGIN_S = 0.001


def hold_steps(prefill_s: float, step_s: float, max_steps: int = len(HOLD_STEPS_S)) -> int:
    """Steps of `step_s` to hold a request whose own prefill is predicted at `prefill_s` before
    deciding it: the number of `HOLD_STEPS_S` it reaches (at most `max_steps`), lowered until the
    hold is within `HOLD_MAX_SHARE` of the prefill. Requests of one step decide together, each
    step after all cheaper ones have been seen."""
    steps = 0
    for at_s in HOLD_STEPS_S[: max(0, max_steps)]:
        if prefill_s < at_s:
            break
        steps += 1
    while steps and steps * step_s > HOLD_MAX_SHARE * prefill_s:
        steps -= 1
    return steps


def hold_for(prefill_s: float, lag_s: float, max_steps: int = len(HOLD_STEPS_S)) -> float:
    """Seconds to hold such a request when peers' dispatches arrive `lag_s` late: `hold_steps`
    steps of the lag plus `HOLD_MARGIN_S`; 0 when the lag is past `HOLD_MAX_LAG_S`."""
    if lag_s > HOLD_MAX_LAG_S:
        return 0.0
    step_s = lag_s + HOLD_MARGIN_S
    return hold_steps(prefill_s, step_s, max_steps) * step_s


class Gateways:
    """The gateways a policy knows of: itself (`name`) and the peers heard within `ttl_s`, bounded.

    Every one heard counts in the deal of home shares, so only gateways of this deployment may be
    (those routing to the same pools): the caller tells which (the gateway drops the batches of
    another deployment on its subject before they reach the policy)."""

    MAX_PEERS = 1024

    __slots__ = ("_heard", "_homes", "_names", "name", "ttl_s")

    def __init__(self, name: str, ttl_s: float = 10.0) -> None:
        self.name = name
        self.ttl_s = ttl_s
        self._heard: OrderedDict[str, float] = OrderedDict()  # oldest heard first
        self._names: tuple[str, ...] | None = None  # `names()`, until a gateway comes or goes
        self._homes: tuple[tuple[str, ...], tuple[WorkerId, ...], frozenset[WorkerId]] | None = None

    def heard(self, origin: str, now_s: float) -> None:
        heard = self._heard
        if origin in heard:
            heard.move_to_end(origin)
        else:
            self._names = None
        heard[origin] = now_s
        if len(heard) > self.MAX_PEERS:
            heard.popitem(last=False)

    def names(self, now_s: float) -> tuple[str, ...]:
        """Every gateway known now, sorted (this one included)."""
        heard = self._heard
        while heard:
            origin, at_s = next(iter(heard.items()))
            if now_s - at_s < self.ttl_s:
                break
            del heard[origin]
            self._names = None
        if self._names is None:
            self._names = tuple(sorted({self.name, *heard}))
        return self._names

    def home(self, workers: Sequence[WorkerId], now_s: float) -> frozenset[WorkerId]:
        """This gateway's share of `workers` (memoized while the gateways and workers stay)."""
        names = self.names(now_s)
        ids = tuple(workers)
        found = self._homes
        if found is not None and found[0] == names and found[1] == ids:
            return found[2]
        home = home_workers(ids, names, self.name)
        self._homes = (names, ids, home)
        return home


def home_workers(workers: Sequence[WorkerId], gateways: Sequence[str], name: str) -> frozenset[WorkerId]:
    """`name`'s share: `workers` sorted by id, dealt in turn to `gateways` sorted by name. With
    more gateways than workers, each gateway gets one worker (some share one)."""
    names = sorted(gateways)
    if name not in names or not workers:
        return frozenset()
    rank, n_gateways = names.index(name), len(names)
    ordered = sorted(workers)
    if n_gateways > len(ordered):
        return frozenset((ordered[rank % len(ordered)],))
    return frozenset(ordered[rank::n_gateways])


def home_choice(
    near: Sequence[tuple[float, int, int, float]],
    home: frozenset[WorkerId],
    ids: Sequence[WorkerId],
    matched: int,
    floor: float,
) -> tuple[float, int, int, float] | None:
    """The best-scored of `near` (score, candidate index, matched, queue) whose worker (`ids[index]`)
    is in `home`, scores at least `floor` and matches at least `matched` tokens; None if none does."""
    found = None
    for entry in near:
        score, i, m, _ = entry
        if score >= floor and m >= matched and ids[i] in home and (found is None or score > found[0]):
            found = entry
    return found
