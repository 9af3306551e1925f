"""Whether a continuation's client waited for the answer before it (`cost`'s `stay_waited_within_s`).

The stay rule (`policies.cost_keep`) may keep a turn that misses the TTFT objective wherever it
goes on its holder, rather than recompute its history elsewhere. That pays where the client waits
for each answer before it sends the next turn (an agent running its tools: a closed loop): the
recompute is saved for everyone, and nothing of that session queues behind the kept turn, since
nothing is sent before it is answered. Where turns keep coming whether or not the last was
answered (an open loop), kept turns pile up behind each other (docs/benchmarks.md, "A
continuation kept where it is answered in time"). So the looser bound is given only to a turn
whose session shows a waiting client.

Sessions are told by their prompts, never by content or by what a client says about itself: a
turn's predecessor is the prompt whose last full block is the block the turn's longest match
ends on (its history is that prompt and its answer). A turn arriving while that prompt is still
in flight was sent without waiting for it. A session counts as waiting when none of its last
`MEMORY_TURNS` turns arrived so: one overlap marks the next `MEMORY_TURNS` turns of its chain,
so an open-loop session that happens to wait once gets nothing looser.

What this gateway sees only: a turn whose predecessor is in flight through another gateway
counts as waited for. Bounded: at most `MAX_CHAINS` chain ends are remembered (the oldest
forgotten: a forgotten end counts as waited for); prompts in flight leave with their outcomes,
and past `MAX_IN_FLIGHT` the oldest counts as ended (outcomes lost), as in `InflightLedger`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.base import WorkerId
from prompt_normalizer.types import BlockKey


class TurnChains:
    """The last block of every prompt in flight (`_in_flight`, a count per block, since two equal
    prompts may be in flight at once), and for recent prompts how many turns of their chain still
    count as not waited for (`_overlap`: 0 once `MEMORY_TURNS` turns in a row were sent after
    their predecessors' answers)."""

    MEMORY_TURNS = 3
    MAX_CHAINS = 65_536
    MAX_IN_FLIGHT = 65_536  # as `InflightLedger.MAX_INFLIGHT`

    def __init__(self) -> None:
        self._in_flight: dict[BlockKey, int] = {}
        self._of: dict[tuple[str, WorkerId], BlockKey] = {}
        self._overlap: OrderedDict[BlockKey, int] = OrderedDict()

    def arrived(self, keys: Sequence[BlockKey], matched_blocks: int) -> bool:
        """A turn whose longest match is its first `matched_blocks` blocks: whether it follows a
        waiting client (the prompt its match ends on is not in flight, and none of the last
        `MEMORY_TURNS` turns of its chain was sent while its own predecessor was; a turn matching
        nothing has no predecessor: True). Its chain's count is kept under its last block for the
        turn after it."""
        if not keys:
            return True
        overlapped = False
        before = 0
        if 0 < matched_blocks <= len(keys):
            end = keys[matched_blocks - 1]
            overlapped = end in self._in_flight
            before = self._overlap.get(end, 0)
        mark = self.MEMORY_TURNS if overlapped else (before - 1 if before > 0 else 0)
        last = keys[-1]
        overlap = self._overlap
        if mark or last in overlap:
            overlap[last] = mark
            overlap.move_to_end(last)
            if len(overlap) > self.MAX_CHAINS:
                overlap.popitem(last=False)
        return not overlapped and before == 0

    def dispatched(self, request_id: str, worker: WorkerId, keys: Sequence[BlockKey]) -> None:
        """A prompt sent to `worker`: its last block is in flight until `ended`."""
        if not keys or (request_id, worker) in self._of:
            return
        last = keys[-1]
        self._of[(request_id, worker)] = last
        self._in_flight[last] = self._in_flight.get(last, 0) + 1
        if len(self._of) > self.MAX_IN_FLIGHT:  # outcomes lost: the oldest counts as ended
            self.ended(*next(iter(self._of)))

    def ended(self, request_id: str, worker: WorkerId) -> None:
        """A prompt's outcome came: it is no longer in flight."""
        last = self._of.pop((request_id, worker), None)
        if last is None:
            return
        n = self._in_flight[last]
        if n > 1:
            self._in_flight[last] = n - 1
        else:
            del self._in_flight[last]
