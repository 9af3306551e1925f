"""`cost`'s decode price: the requests a new prefill would push over the TPOT objective.

A chunked-prefill engine computes a prompt in steps of `max_batched_tokens`, and every request
decoding on the worker waits for each of those steps: a 30,000-token prompt turns four of a
decode's ~10 ms steps into steps of 0.2-0.4 s. A request with few output tokens has little TPOT
budget to absorb that (`tpot_objective_s` × its tokens after the first: 0.6 s for 7 tokens at
0.1 s), so one long prefill beside it makes it miss. With `decode_price_s` > 0, a candidate is
charged that many seconds for each request in flight there whose TPOT this request's prefill
would push over the objective (within it without the prefill, over it with), and, given
`ttft_objective_s`, for a prompt that matches nothing and is predicted to miss that objective
there (so the price does not just move it to a worker where it misses the TTFT instead).

The model of one candidate, from now on (all seconds calibrated, `DecodeLedger` the requests):

    |-- the backlog's prefill: steps of `ahead_step_s` --|-- this prefill: steps of `own_step_s` --|

Each request decodes one token a step, from its predicted first token (its decision's queue plus
its own prefill) or from now, whichever is later; tokens already out are counted at the normal
step (`decode_s`). A request that finishes within the backlog is not reached. The others get
`own_step_s − decode_s` more for each of their tokens in this prefill's steps.

Only this gateway's own dispatches are in the ledger (not a peer's, nor another client's), and a
request without `max_output_tokens`, or with one token (no TPOT), is not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from policies.base import WorkerId, WorkerView
from policies.cost_model import CostModel


class DecodeLedger:
    """This gateway's requests in flight with more than one output token: per worker, request id →
    (output tokens after the first, predicted first-token time). `by_worker[w]` is empty or absent
    when none is in flight on `w`; bounded by `MAX_INFLIGHT` (the oldest entry leaves first)."""

    MAX_INFLIGHT = 65_536

    def __init__(self) -> None:
        self._order: OrderedDict[tuple[str, WorkerId], None] = OrderedDict()
        self.by_worker: dict[WorkerId, dict[str, tuple[int, float]]] = {}

    def add(
        self, request_id: str, worker: WorkerId, max_output_tokens: int | None, first_token_s: float
    ) -> None:
        if max_output_tokens is None or max_output_tokens < 2:
            return
        key = (request_id, worker)
        self._order[key] = None
        self.by_worker.setdefault(worker, {})[request_id] = (max_output_tokens - 1, first_token_s)
        if len(self._order) > self.MAX_INFLIGHT:
            self.remove(*next(iter(self._order)))

    def remove(self, request_id: str, worker: WorkerId) -> None:
        key = (request_id, worker)
        if key not in self._order:
            return
        del self._order[key]
        entries = self.by_worker[worker]
        del entries[request_id]
        if not entries:
            del self.by_worker[worker]

    def __len__(self) -> int:
        return len(self._order)

    def check_invariants(self) -> None:
        keys = {(r, w) for w, entries in self.by_worker.items() for r in entries}
        assert keys == set(self._order)
        assert all(self.by_worker.values())
        assert all(tokens >= 1 for entries in self.by_worker.values() for tokens, _ in entries.values())


def pushed_over(
    decodes: Iterable[tuple[int, float]],
    now_s: float,
    objective_s: float,
    decode_s: float,
    ahead_s: float,
    ahead_step_s: float,
    own_s: float,
    own_step_s: float,
) -> int:
    """How many of `decodes` ((tokens after the first, first-token time), `DecodeLedger`) a
    prefill of `own_s` seconds in steps of `own_step_s`, after a backlog of `ahead_s` seconds in
    steps of `ahead_step_s`, pushes from within `objective_s` a token to over it (the module
    docstring has the model; `decode_s` is the worker's decode step without prefill)."""
    extra = own_step_s - decode_s
    if extra <= 0 or own_s <= 0:
        return 0
    ahead_end = now_s + ahead_s
    own_end = ahead_end + own_s
    pushed = 0
    for tokens, first_s in decodes:
        if first_s < now_s:
            spent = now_s - first_s
            left = tokens - spent / decode_s
            if left < 1.0:
                # Still in flight past its predicted end: slowed, or its first token came late.
                # Its last token at least is still to come.
                left = 1.0
            at = now_s
        else:
            spent, left, at = 0.0, float(tokens), first_s
        if at < ahead_end:
            slow = (ahead_end - at) / ahead_step_s
            if slow >= left:
                continue  # done within the backlog: this prefill never reaches it
            spent += ahead_end - at
            left -= slow
            at = ahead_end
        if at >= own_end:
            continue
        exposed = (own_end - at) / own_step_s
        if exposed > left:
            exposed = left
        spent += left * decode_s
        budget = objective_s * tokens
        if spent <= budget < spent + exposed * extra:
            pushed += 1
    return pushed


class DecodePrice:
    """One decision's decode price (the module docstring): what a candidate is charged, in
    seconds, for the misses this request's prefill there would cause."""

    __slots__ = ("cost", "decodes", "n", "now_s", "objective_s", "own_for", "price_s", "tpot_s", "unit")

    def __init__(
        self,
        price_s: float,
        tpot_objective_s: float,
        ttft_objective_s: float | None,
        decodes: DecodeLedger,
        cost: CostModel,
        n_engine_tokens: int,
        now_s: float,
    ) -> None:
        self.price_s = price_s
        self.tpot_s = tpot_objective_s
        # None: the request's own TTFT is not priced (no objective, or its prompt matches somewhere).
        self.objective_s = ttft_objective_s
        self.decodes = decodes.by_worker
        self.cost = cost
        self.unit = cost.engine_tokens_per_request_token
        self.n = n_engine_tokens
        self.now_s = now_s
        self.own_for: dict[int, tuple[float, int]] = {}

    def charge(
        self, view: WorkerView, matched: int, backlog: float, ahead_s: float, running: int, queue_s: float
    ) -> float:
        """The price on `view` for a request matching `matched` request tokens there, behind
        `backlog` engine tokens of prefill taking `ahead_s`, beside `running` requests, predicted to
        wait `queue_s` before its own prefill."""
        decodes = self.decodes.get(view.worker_id)
        objective = self.objective_s
        if not decodes and objective is None:
            return 0.0
        own = self.own_for.get(matched)
        if own is None:
            m = matched if self.unit == 1.0 else int(matched * self.unit)
            new = self.n - m
            steps = -(-new // self.cost.params.max_batched_tokens) if new > 0 else 0
            own = self.own_for[matched] = (self.cost.prefill_s(new, m), steps)
        own_s, own_steps = own
        misses = 0
        if objective is not None and queue_s + own_s > objective:
            misses = 1
        if decodes and own_steps:
            cost = self.cost
            p = cost.params
            context = view.decode_context_tokens
            decode_s = cost.decode_step_s(running, context if self.unit == 1.0 else int(context * self.unit))
            # A prefill step is a decode step that also computes its chunk: the chunk's share of
            # the prefill's time, less the step overhead the decode step already counts.
            overhead = cost.scale * p.step_s
            ahead_steps = -(-int(backlog) // p.max_batched_tokens)
            ahead_step_s = ahead_s / ahead_steps + decode_s - overhead if ahead_steps else decode_s
            own_step_s = own_s / own_steps + decode_s - overhead
            misses += pushed_over(
                decodes.values(), self.now_s, self.tpot_s, decode_s, ahead_s, ahead_step_s, own_s, own_step_s
            )
        return self.price_s * misses
