"""Which deployment a gateway is part of, as its batches say: the fingerprints of its pools.

The gateways of one deployment route to the same pools: pools of the same names, serving the same
model ids. Every batch carries the fingerprint of each pool of its sender (`SyncBatch.pools`): a
hash of the pool's name and its model ids, sorted (what it hashes is configuration, nothing of a
request). A receiver takes the sender for a peer when they have a pool in common, and applies of
its batches only what concerns such pools. Another deployment publishing on the same subject (the
default subject is the same for every deployment given none) is neither counted as a gateway nor
applied, whatever it calls its pools: a pool of the same name serving other models is another pool.

Workers are left out on purpose: while discovery adds or removes one, two gateways of a
deployment see different workers (a peer's holdings of a worker not discovered here yet wait for
it, `parking`), and they still route to the same pools. Block sizes are left out too: a
gateway of another block size in front of the same workers weighs on them all the same (its load
counts), only its holdings cannot match (`subscriber` drops them). What this cannot tell apart is
two deployments with pools of the same names serving the same models: each needs a subject of its
own (`sync.subject_prefix`; the Helm chart's is per release).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from gateway.sync.codec import MAX_BATCH_POOLS


def pool_fingerprint(name: str, models: Iterable[str]) -> int:
    """The fingerprint of pool `name` serving `models` (in any order): a u64."""
    doc = json.dumps([name, sorted(set(models))], separators=(",", ":")).encode()
    digest = hashlib.blake2b(doc, digest_size=8, person=b"kvgate-sync-pool").digest()
    return int.from_bytes(digest, "little")


def fingerprints(pools: Iterable[tuple[str, Sequence[str]]]) -> dict[str, int]:
    """Each pool's fingerprint, by name, from (name, model ids) pairs."""
    return {name: pool_fingerprint(name, models) for name, models in pools}


def published(marks: dict[str, int]) -> tuple[int, ...]:
    """What a batch says of its sender's pools: their fingerprints, sorted, at most what peers
    accept (`MAX_BATCH_POOLS`, far beyond any configuration)."""
    return tuple(sorted(marks.values()))[:MAX_BATCH_POOLS]
