"""The event loop's longest stall in each phase of reading and keying one large body, in process.

    python -m loadtest.bench_loop_stall --write-bodies /tmp/bodies
    python -m gateway.keying_bench /tmp/bodies --repeats 3

For each chat body in the folder (`SHAPE.json`; the loop-stall benchmark writes its shapes, about
7 MB each), a probe task on the loop measures how late `asyncio.sleep(0.001)` wakes while one
phase runs, as admission ran it before the keying process and as it runs now:

- `parse`, `encode`: `parse_body` and `encode_body` on the loop;
- `key_thread`: `Normalizer.canonicalize` on a thread (it holds the GIL in long calls);
- `process`: the keying process (`gateway.keying_pool`, started before the first timed body)
  reading and keying the body, then the loop rebuilding the body (and a rewritten body) from
  its pieces and observing its drift: everything `keying.read_large_body` does.

Printed per shape and phase: the slowest and p99 lateness (ms) and the phase's median duration,
over `--repeats` runs, with the lateness of the same probe alone first (the baseline). The
garbage collector is tuned as the gateway tunes it (`gateway.server.tune_gc`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.bodies import encode_body, parse_body
from gateway.keying_pool import KeyingPool, Turns, rebuild
from gateway.large_body import BodyJob, ModelKeying
from gateway.routes import ROUTES
from gateway.server import tune_gc
from prompt_normalizer.keys import public_identity_of
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity

SECRET = b"bench-keying-phases-0123456789ab"
MODEL = "bench-model"
CHAT = ROUTES["/v1/chat/completions"]


async def _timed(phase: Callable[[], Awaitable[Any]]) -> tuple[list[float], float]:
    """The probe's lateness while `phase` runs, and the phase's duration (s)."""
    lateness: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - started - 0.001)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.005)
    started = time.perf_counter()
    await phase()
    took = time.perf_counter() - started
    done.set()
    await task
    return lateness, took


def _summary(lateness: list[float], took: list[float]) -> dict[str, float]:
    ordered = sorted(lateness)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "slowest_ms": round(ordered[-1] * 1e3, 1),
        "p99_ms": round(p99 * 1e3, 1),
        "median_phase_ms": round(statistics.median(took) * 1e3, 1),
    }


async def run(bodies: dict[str, bytes], repeats: int) -> dict[str, Any]:
    config = NormalizerConfig()
    identity = KeyIdentity(model_id=MODEL, block_size_tokens=16)
    public = public_identity_of(identity)
    here, there = Normalizer(config, SECRET), Normalizer(config, SECRET)
    thread = concurrent.futures.ThreadPoolExecutor(1)
    pool = KeyingPool()
    models = {MODEL: ModelKeying(config, identity, public)}
    out: dict[str, Any] = {"load_average": os.getloadavg()}
    tune_gc()  # as the gateway runs
    try:
        lateness, _ = await _timed(lambda: asyncio.sleep(1.0))
        out["baseline"] = _summary(lateness, [1.0])
        started = time.perf_counter()
        await pool.key(
            BodyJob(
                b'{"messages": [{"role": "user", "content": "x"}]}', CHAT.path, 128, SECRET, models, None
            ),
            "bench",
        )
        out["keying_process_start_s"] = round(time.perf_counter() - started, 2)
        for shape, raw in bodies.items():
            body = parse_body(raw, CHAT)
            encode_body(body)

            async def parse(raw: bytes = raw) -> None:
                parse_body(raw, CHAT)

            async def encode(body: dict[str, Any] = body) -> None:
                encode_body(dict(body))

            async def key_thread(body: dict[str, Any] = body) -> None:
                canonicalize = here.canonicalize
                await asyncio.get_running_loop().run_in_executor(
                    thread, lambda: canonicalize("chat", body, identity, public)
                )

            async def process(raw: bytes = raw) -> None:
                keyed = await pool.key(BodyJob(raw, CHAT.path, 128, SECRET, models, None), "bench")
                assert keyed is not None and keyed.body is not None and keyed.canonical is not None
                turns = Turns()
                await rebuild(keyed.body, turns)
                canonical = keyed.canonical
                if keyed.canonical_body is not None:
                    rewritten = await rebuild(keyed.canonical_body, turns)
                    canonical = dataclasses.replace(canonical, canonical_body=rewritten)
                if keyed.pending is not None:
                    there.observe_pending(canonical, keyed.pending)

            phases: dict[str, Callable[[], Awaitable[None]]] = {
                "parse": parse,
                "encode": encode,
                "key_thread": key_thread,
                "process": process,
            }
            out[shape] = {}
            for name, phase in phases.items():
                lateness, took = [], []
                for _ in range(repeats):
                    late, seconds = await _timed(phase)
                    lateness += late
                    took.append(seconds)
                out[shape][name] = _summary(lateness, took)
    finally:
        pool.close()
        thread.shutdown()
    out["load_average_after"] = os.getloadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="chat bodies, one per SHAPE.json")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each phase per body")
    args = parser.parse_args()
    bodies = {path.stem: path.read_bytes() for path in sorted(args.folder.glob("*.json"))}
    if not bodies:
        parser.error(f"no *.json bodies in {args.folder}")
    print(json.dumps(asyncio.run(run(bodies, args.repeats)), indent=1))


if __name__ == "__main__":
    main()
