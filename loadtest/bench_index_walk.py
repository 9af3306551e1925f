"""What recording a long prompt in `cost`'s prefix index costs the event loop.

A routed request's keys are recorded on its worker at dispatch and confirmed at completion. A
prompt longer than the worker's capacity (27,000 blocks here, the decision bench's workers; the
index keeps 0.9 of it) can be held only up to that capacity. The bench times dispatch plus
completion for chains of several lengths on a fresh `cost` policy each time and prints each
against the chain that just fills the capacity, measured in the same run: about 1× past the
capacity means the walk stops there.

    python -m loadtest.bench_index_walk [--blocks 8000,24300,110000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from policies.base import Observation
from policies.bench import _keys, _request, _views
from policies.registry import make_policy

CAPACITY_BLOCKS = 24_300  # the bench workers' 27,000 blocks at the index's capacity_fraction 0.9


def walk_ms(blocks: int, repeats: int, seed: int = 0) -> list[float]:
    """Dispatch plus completion of one `blocks`-long chain, in ms, once per fresh policy."""
    rng = random.Random(seed)
    keys = _keys(rng, blocks)
    views = _views(rng, 8)
    out = []
    for i in range(repeats):
        policy = make_policy("cost", seed=seed)
        req = _request(f"r{i}", keys)
        decision = policy.select(req, views, 0.0)
        assert decision is not None
        started = time.perf_counter()
        policy.on_dispatch(req, decision, 0.0)
        policy.on_complete(Observation(req, decision.worker, prompt_tokens=req.n_prompt_tokens), 0.1)
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=f"8000,{CAPACITY_BLOCKS},110000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    medians = {b: statistics.median(walk_ms(b, args.repeats)) for b in [CAPACITY_BLOCKS, *sizes]}
    base = medians[CAPACITY_BLOCKS]
    rows = [
        {"blocks": b, "median_ms": round(medians[b], 1), "vs_capacity_chain": round(medians[b] / base, 2)}
        for b in sizes
    ]
    print(json.dumps({"load_average": os.getloadavg(), "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
