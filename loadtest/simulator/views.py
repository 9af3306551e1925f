"""What each simulated gateway sees of the workers when it decides: its `WorkerView`s.

A view is built from the gateway's own in-flight accounting (`SimGateway`, as the gateway's
registry keeps it) plus the last scrape of the engine's stats, refreshed every `scrape_interval_s`
of virtual time, folded with the load its peers reported. Views are cached per gateway and worker
(`SimGateway.views`): an entry is rebuilt only after the accounting or the scrape behind it changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.simulator.flights import SimWorker
from loadtest.simulator.gateways import SimGateway
from policies.base import Role, WorkerView


class GatewayViews:
    """The views one gateway sees (called per decision), over the loop's workers and gateways."""

    def __init__(
        self,
        workers: Sequence[SimWorker],
        gateways: Sequence[SimGateway],
        roles: Sequence[Role],
        scrape_interval_s: float,
        max_in_flight_per_worker: int | None,
    ) -> None:
        self.workers = workers
        self.gateways = gateways
        self.roles = roles
        self.scrape_interval_s = scrape_interval_s
        self.max_in_flight_per_worker = max_in_flight_per_worker

    def __call__(self, now_s: float, gw: SimGateway, pool: str) -> list[WorkerView]:
        """What gateway `gw` sees: its own in-flight accounting, its peers' reports, the scrape."""
        out = []
        cache = gw.views
        for i, w in enumerate(self.workers):
            if now_s - w.scrape_s >= self.scrape_interval_s:
                w.scrape = w.engine.stats()
                w.scrape_s = now_s
                # Each gateway's requests there at that moment, its peers' included (as it sees them).
                w.scrape_in_flight = [
                    g.fold(pool, WorkerView(w.id, in_flight_requests=g.in_flight[i])).in_flight_requests
                    for g in self.gateways
                ]
                for g in self.gateways:
                    g.views[i] = None
            view = cache[i]
            if view is None:
                s = w.scrape
                view = cache[i] = WorkerView(
                    worker_id=w.id,
                    in_flight_requests=gw.in_flight[i],
                    in_flight_prefill_tokens=gw.prefill[i],
                    in_flight_prefill_pairs=gw.pairs[i],
                    in_flight_decode_tokens=gw.decode[i],
                    max_in_flight=self.max_in_flight_per_worker,
                    num_requests_waiting=s.num_waiting,
                    num_requests_running=s.num_running,
                    kv_usage=s.kv_usage,
                    num_gpu_blocks=s.num_kv_blocks,
                    engine_block_size=w.engine.block_size,
                    role=self.roles[i],
                    in_flight_at_scrape=w.scrape_in_flight[gw.index],
                    decode_context_tokens=gw.context[i],
                    prefill_started_s=gw.prefill_started[i],
                )
            out.append(gw.fold(pool, view))
        return out
