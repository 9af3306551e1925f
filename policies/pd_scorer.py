"""The terms of a P/D request's options, in seconds (`policies.pd` combines them): the prefill
worker's score, a transfer, the decode worker's batch, the interference a prefill adds to the
requests a decode worker runs, and the penalty for a worker whose KV cannot hold the request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.base import RouteRequest, WorkerView
from policies.cost_model import CostModel
from policies.pools import load_of

if TYPE_CHECKING:
    from policies.pd import PdSettings


class PdScorer:
    """The terms of one request's options (engine tokens throughout)."""

    __slots__ = ("adapter", "cost", "n", "out", "settings", "unit")

    def __init__(self, settings: PdSettings, cost: CostModel, req: RouteRequest) -> None:
        self.settings = settings
        self.cost = cost
        self.unit = cost.engine_tokens_per_request_token
        self.n = int(req.n_prompt_tokens * self.unit)
        self.out = req.max_output_tokens or settings.default_output_tokens
        self.adapter = req.adapter

    def engine(self, request_tokens: int) -> int:
        """Request tokens (the normalizer's count) in engine tokens, at most the prompt."""
        return min(int(request_tokens * self.unit), self.n)

    def request_tokens(self, engine_tokens: int) -> int:
        return int(engine_tokens / self.unit)

    def prefill_s(self, view: WorkerView, matched: int, backlog_share: float = 1.0) -> float:
        """The design's score of the prefill worker: saved − queue − cold (the backlog counted
        at `backlog_share` of its whole prompts)."""
        cost = self.cost
        return (
            cost.saved_s(self.n, matched)
            - cost.queue_s(view, self.n - matched, backlog_share)
            - cost.cold_s(view, self.adapter)
        )

    def split_s(self, view: WorkerView, held: int) -> float:
        """What decoding on `view` after a transfer adds to the prefill score (all costs)."""
        transfer = self.settings.transfer_s(self.n - held)
        return -transfer - self.decode_s(view) - self.kv_s(view)

    def alone_s(self, view: WorkerView, held: int) -> float:
        """The score of `view` computing what it lacks and decoding the answer itself."""
        new = self.n - held
        interference = self.interference_s(view, new, held)
        return self.prefill_s(view, held) - interference - self.decode_s(view) - self.kv_s(view)

    def decode_s(self, view: WorkerView) -> float:
        """Output tokens × one decode step at the worker's batch with this request admitted."""
        context = view.in_flight_decode_tokens + self.n + self.out // 2
        return self.out * self.cost.decode_step_s(load_of(view) + 1, context)

    def interference_s(self, view: WorkerView, new: int, held: int) -> float:
        """The delay a prefill of `new` tokens on `view` adds to the requests it decodes: the
        prefill's compute (the step's fixed cost is paid by the decodes anyway) for each request
        running there, and at least one (a decode worker's compute is kept for decoding: an idle
        one's next arrivals wait behind the prefill)."""
        weight = self.settings.interference_weight
        if new <= 0 or weight == 0:
            return 0.0
        cost = self.cost
        steps = -(-new // cost.params.max_batched_tokens)
        compute = cost.prefill_s(new, held) - cost.scale * cost.params.step_s * steps
        return weight * max(1, load_of(view)) * max(0.0, compute)

    def kv_s(self, view: WorkerView) -> float:
        """A fixed penalty when the worker's free KV (as last reported) cannot hold the request."""
        if view.kv_usage is None or view.num_gpu_blocks is None:
            return 0.0
        capacity = view.num_gpu_blocks * (view.engine_block_size or 16)
        free = capacity * max(0.0, 1.0 - view.kv_usage)
        return self.settings.kv_full_penalty_s if free < self.n + self.out else 0.0
