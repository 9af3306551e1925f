"""Factories for policy tests: chained keys per namespace, requests and worker views."""

from __future__ import annotations

import xxhash

from policies.base import Isolation, RouteRequest, WorkerId, WorkerView
from prompt_normalizer.types import PUBLIC_NAMESPACE, BlockKey

BS = 16


def chain(namespace: str, blocks: list[int] | range) -> tuple[BlockKey, ...]:
    """Chained keys over abstract block contents, rooted in `namespace` (like the normalizer)."""
    prev = xxhash.xxh3_64_intdigest(namespace.encode())
    keys = []
    for b in blocks:
        prev = xxhash.xxh3_64_intdigest(str(b).encode(), seed=prev)
        keys.append(BlockKey(prev))
    return tuple(keys)


def req(
    rid: str,
    blocks: list[int] | range,
    *,
    tenant: str = "t",
    namespace: str | None = None,
    extra_tokens: int = 1,
    isolation: Isolation = Isolation.STRICT,
    immutable: int = 0,
    pool: str = "p",
    session: str | None = None,
) -> RouteRequest:
    ns = namespace or tenant
    blocks = list(blocks)
    return RouteRequest(
        request_id=rid,
        pool=pool,
        tenant=tenant,
        namespace=ns,
        block_keys=chain(ns, blocks),
        n_prompt_tokens=len(blocks) * BS + extra_tokens,
        block_size_tokens=BS,
        isolation=isolation,
        public_block_keys=chain(PUBLIC_NAMESPACE, blocks[:immutable]) if immutable else (),
        immutable_blocks=immutable,
        session_key=session,
    )


def workers(
    *loads: int, prefill: tuple[int, ...] | None = None, blocks: int | None = None
) -> list[WorkerView]:
    pf = prefill or (0,) * len(loads)
    return [
        WorkerView(
            WorkerId(f"w{i}"),
            in_flight_requests=n,
            in_flight_prefill_tokens=p,
            num_gpu_blocks=blocks,
            engine_block_size=BS if blocks is not None else None,
        )
        for i, (n, p) in enumerate(zip(loads, pf, strict=True))
    ]
