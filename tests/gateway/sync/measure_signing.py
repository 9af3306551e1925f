"""What sealing costs a batch: encode and decode per batch, sealed (`codec.encode`, `codec.decode`:
the HMAC tag made, verified) against the body alone (`encode_body`, `decode_body`: version 1's
work, less its "v" field), interleaved in one process.

    python -m tests.gateway.sync.measure_signing --rounds 5 --batches 2000

Three batch shapes: a load refresh (16 load rows, no items), one dispatch (a 128-key holding, its
outcome, a load row: what a 2,048-token prompt at 16-token blocks publishes) and a busy batch (64
such holdings and outcomes). Each figure is the median over rounds of the mean µs per batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from gateway.sync.codec import SyncBatch, decode, decode_body, encode, encode_body
from gateway.sync.signing import BatchKey
from policies.base import WorkerId
from policies.peer_sync import PeerHolding, PeerItem, PeerLoad, PeerOutcome
from prompt_normalizer.bench import git_sha
from prompt_normalizer.types import BlockKey


def _batches(rng: random.Random, now_s: float) -> dict[str, SyncBatch]:
    workers = [WorkerId(f"http://10.0.0.{i}:8000") for i in range(16)]
    loads = tuple(
        PeerLoad("chat", w, rng.randrange(8), rng.randrange(10**5), rng.randrange(10**4)) for w in workers
    )

    def dispatch(ref: int) -> tuple[PeerItem, ...]:
        keys = tuple(BlockKey(rng.getrandbits(64)) for _ in range(128))
        worker = workers[rng.randrange(len(workers))]
        return PeerHolding(ref, "chat", 16, "tenant:team-a", keys, worker, 2048, 1024), PeerOutcome(ref, True)

    busy = tuple(item for ref in range(64) for item in dispatch(ref))
    pools = (rng.getrandbits(64),)
    return {
        "load refresh": SyncBatch("gw:1:abc", 1, now_s, True, (), loads, 0.0, pools),
        "one dispatch": SyncBatch("gw:1:abc", 2, now_s, False, dispatch(1), loads[:1], 0.004, pools),
        "64 dispatches": SyncBatch("gw:1:abc", 3, now_s, False, busy, loads[:4], 0.004, pools),
    }


def _us_per_call(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--batches", type=int, default=2000, help="batches encoded and decoded per round and shape"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    now_s = time.time()
    key = BatchKey(b"measure-signing-secret-of-32-bytes")
    batches = _batches(random.Random(args.seed), now_s)
    print(f"git {git_sha()}; {args.rounds} rounds of {args.batches} batches a shape; seed {args.seed}")
    print("| batch | bytes (body / sealed) | encode µs (body / sealed, ratio) | decode µs (same) |")
    print("|---|---:|---:|---:|")
    for name, batch in batches.items():
        body, sealed = encode_body(batch), encode(batch, key)
        assert decode(sealed, key, now_s) == decode_body(body, now_s) == batch
        rows: dict[str, list[float]] = {"eb": [], "es": [], "db": [], "ds": []}
        n = args.batches if name != "64 dispatches" else max(1, args.batches // 16)
        for _ in range(args.rounds):  # interleaved: a drift of the machine's load hits both alike
            rows["eb"].append(_us_per_call(partial(encode_body, batch), n))
            rows["es"].append(_us_per_call(partial(encode, batch, key), n))
            rows["db"].append(_us_per_call(partial(decode_body, body, now_s), n))
            rows["ds"].append(_us_per_call(partial(decode, sealed, key, now_s), n))
        eb, es, db, ds = (statistics.median(rows[k]) for k in ("eb", "es", "db", "ds"))
        print(
            f"| {name} | {len(body):,} / {len(sealed):,} | {eb:.1f} / {es:.1f}, {es / eb:.3f}× "
            f"| {db:.1f} / {ds:.1f}, {ds / db:.3f}× |"
        )


if __name__ == "__main__":
    main()
