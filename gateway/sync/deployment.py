"""Which deployment a gateway is part of, as its batches say: the fingerprints of its pools.

The gateways of one deployment share one key-hash secret (the prefix keys, and so the index, are
keyed by it: a gateway with another secret could match none of them) and route to the same
pools: pools of the same names, serving the same model ids. Every batch carries the fingerprint of
each pool of its sender (`SyncBatch.pools`): a hash of the pool's name and its model ids, sorted,
keyed by the secret (what it hashes is configuration, nothing of a request; without the secret a
fingerprint says nothing of it). A receiver takes the sender for a peer when they have a pool in
common, and applies of its batches only what concerns such pools. Another deployment publishing on
the same subject (the default subject is the same for every deployment given none) is neither
counted as a gateway nor applied, whatever it calls its pools: a pool of the same name serving
other models is another pool, and so is a pool of the same name and models keyed by another
secret.

Workers are left out on purpose: while discovery adds or removes one, two gateways of a
deployment see different workers (a peer's holdings of a worker not discovered here yet wait for
it, `parking`), and they still route to the same pools. Block sizes are left out too: a
gateway of another block size in front of the same workers weighs on them all the same (its load
counts), only its holdings cannot match (`subscriber` drops them). What this cannot tell apart is
two deployments sharing a secret with pools of the same names serving the same models: each needs
a subject of its own (`sync.subject_prefix`; the Helm chart's is per release).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from gateway.sync.codec import MAX_BATCH_POOLS


def pool_fingerprint(name: str, models: Iterable[str], secret: bytes) -> int:
    """The fingerprint of pool `name` serving `models` (in any order) in the deployment of key-hash
    secret `secret`: a u64."""
    doc = json.dumps([name, sorted(set(models))], separators=(",", ":")).encode()
    digest = hashlib.blake2b(doc, digest_size=8, key=_key(secret), person=b"kvgate-sync-pool").digest()
    return int.from_bytes(digest, "little")


def fingerprints(pools: Iterable[tuple[str, Sequence[str]]], secret: bytes) -> dict[str, int]:
    """Each pool's fingerprint, by name, from (name, model ids) pairs."""
    return {name: pool_fingerprint(name, models, secret) for name, models in pools}


def _key(secret: bytes) -> bytes:
    # blake2b takes a key of at most 64 bytes: a secret of any length is first hashed to one.
    return hashlib.blake2b(secret, digest_size=32, person=b"kvgate-sync-key").digest()


def published(marks: dict[str, int]) -> tuple[int, ...]:
    """What a batch says of its sender's pools: their fingerprints, sorted, at most what peers
    accept (`MAX_BATCH_POOLS`, far beyond any configuration)."""
    return tuple(sorted(marks.values()))[:MAX_BATCH_POOLS]
