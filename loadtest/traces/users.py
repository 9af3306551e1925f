"""Replay one session trace as many users.

Each user gets its own salt by folding the user index into every block id past the shared prefix
(ids are shifted into a disjoint range `(user + 1) << 40`), so users share only the first
`shared_prefix_blocks` blocks (the system prompt and tool schemas every user of an agent sees) and
never each other's history. Users start at seeded offsets spread uniformly over `spread_s`.
"""

from __future__ import annotations

import numpy as np

from loadtest.workloads.records import BlockPrompt, WorkloadRequest

_USER_SHIFT = 40


def replay_as_users(
    requests: list[WorkloadRequest] | tuple[WorkloadRequest, ...],
    n_users: int,
    *,
    shared_prefix_blocks: int = 0,
    spread_s: float = 0.0,
    tenant_per_user: bool = False,
    seed: int = 0,
) -> list[WorkloadRequest]:
    if n_users < 1:
        raise ValueError("n_users must be at least 1")
    rng = np.random.default_rng(seed)
    offsets = rng.uniform(0.0, spread_s, size=n_users) if spread_s > 0 else np.zeros(n_users)
    offsets[0] = 0.0
    out: list[WorkloadRequest] = []
    for user in range(n_users):
        shift = (user + 1) << _USER_SHIFT
        for r in requests:
            p = r.prompt
            if isinstance(p, BlockPrompt):
                ids = tuple(
                    h if j < shared_prefix_blocks else (h & ((1 << _USER_SHIFT) - 1)) | shift
                    for j, h in enumerate(p.block_ids)
                )
                p = BlockPrompt(ids, p.block_size_tokens, p.n_tokens, p.salt, p.immutable_blocks)
            tenant = f"{r.tenant}-u{user}" if tenant_per_user else r.tenant
            out.append(
                WorkloadRequest(
                    f"u{user}/{r.request_id}",
                    r.arrival_s + float(offsets[user]),
                    tenant,
                    f"u{user}/{r.session}" if r.session else "",
                    p,
                    r.max_output_tokens,
                    tuple(f"u{user}/{rid}" for rid in r.follows),
                    r.think_s,
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out
