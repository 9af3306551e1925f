"""Each sender's newest batch: a peer's batch is applied once, and never after a newer one of its sender.

A publisher numbers its batches 1, 2, 3... (`SyncBatch.seq`), and core NATS delivers one
connection's messages in order, so a batch at or below the newest number seen from its sender is
a copy (a redelivery, a replay by anyone who can publish on the subject) or was overtaken. Applied,
it would set the sender's load back to an older snapshot (loads replace each other, they do not
add up) and record again holdings its outcomes had already settled. Such a batch is dropped whole
and counted (`replayed`); a gap above the newest counts the batches lost on the way (`lost`).

A sender's newest number is remembered for `MEMORY_S` after its last batch: twice the clock skew
a batch's send time may have (`codec.MAX_CLOCK_SKEW_S`, either way), so that any copy of one of
its batches is refused for its send time before the number is forgotten. At most `MAX_SENDERS`
are remembered, the one heard from least recently forgotten first: made-up senders can push a
real one's number out, after which one copy of its batches applies again. Only a holder of the
deployment's key-hash secret can make up a sender (batches are sealed, `signing`; see
docs/sync.md, "Known limits").
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.sync.codec import MAX_CLOCK_SKEW_S


class SenderSequences:
    """The newest batch number of each sender heard within `MEMORY_S`, at most `MAX_SENDERS`.

    Invariant: `_newest` is ordered by when its senders were last heard (monotonic clock), oldest
    first, so that forgetting is a look at its head."""

    MAX_SENDERS = 4096
    MEMORY_S = 2 * MAX_CLOCK_SKEW_S
    # The most one gap counts as lost: a sender batches at most every few milliseconds, so a gap
    # beyond this is a made-up number (a forger numbering past a real peer), not traffic lost,
    # and counted whole it would make `lost_batches` jump by up to 2^63.
    MAX_COUNTED_GAP = 1 << 20

    __slots__ = ("_newest", "lost", "replayed")

    def __init__(self) -> None:
        self._newest: OrderedDict[str, tuple[int, float]] = OrderedDict()  # origin -> (seq, heard at)
        self.lost = 0  # batches never received: gaps in a sender's numbers
        self.replayed = 0  # batches at or below their sender's newest number, dropped

    def admit(self, origin: str, seq: int, now_s: float) -> bool:
        """Whether batch `seq` of `origin`, received at `now_s`, is newer than any seen from it;
        if so it becomes the newest, else it is counted as `replayed`."""
        newest = self._newest
        found = newest.get(origin)
        if found is not None and now_s - found[1] < self.MEMORY_S:
            if seq <= found[0]:
                self.replayed += 1
                return False
            gap = seq - found[0] - 1
            self.lost += gap if gap < self.MAX_COUNTED_GAP else self.MAX_COUNTED_GAP
        newest.pop(origin, None)
        newest[origin] = (seq, now_s)
        self.expire(now_s)
        return True

    def expire(self, now_s: float) -> None:
        """Forget the senders not heard within `MEMORY_S`, and beyond `MAX_SENDERS` the ones heard
        from least recently."""
        newest = self._newest
        while newest:
            origin, (_, heard_s) = next(iter(newest.items()))
            if now_s - heard_s < self.MEMORY_S and len(newest) <= self.MAX_SENDERS:
                break
            del newest[origin]

    def __len__(self) -> int:
        return len(self._newest)

    def check_invariants(self) -> None:
        heard = [at_s for _, at_s in self._newest.values()]
        assert heard == sorted(heard), "senders out of the order they were heard in"
        assert len(self._newest) <= self.MAX_SENDERS
