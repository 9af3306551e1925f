"""The `RouteRequest` a policy sees for a workload request, as the gateway would build it.

Namespace: the tenant's name; every chain is rooted at `xxh3_64(namespace ␟ salt)` (see
`loadtest.workloads.chains`), so tenants never share keys. Policy blocks: a trace prompt keeps the
trace's own blocks (one key per 512-token Mooncake block or 64-token kv-cache-tester block) because
that is all the prefix structure the trace carries and it keeps the index small; only blocks that
lie wholly inside the prompt get a key, as with the normalizer (a partial last block has none).
Chat and text prompts are cut into `text_block_tokens`-byte blocks of the rendered prompt.
"""

from __future__ import annotations

from loadtest.workloads.chains import chain_bytes, chain_ids, chain_root
from loadtest.workloads.records import BlockPrompt, WorkloadRequest
from policies.base import Isolation, RouteRequest
from prompt_normalizer.types import BlockKey


def route_request(
    req: WorkloadRequest, prompt: bytes | None, *, pool: str = "default", text_block_tokens: int = 16
) -> RouteRequest:
    """`prompt` is the rendered prompt; None for a trace prompt, which needs no text."""
    p = req.prompt
    if isinstance(p, BlockPrompt):
        n_tokens = p.n_tokens
        n_full = min(len(p.block_ids), p.n_tokens // p.block_size_tokens)
        keys = chain_ids(chain_root(req.tenant, p.salt), p.block_ids[:n_full])
        block_size = p.block_size_tokens
    else:
        if prompt is None:
            raise ValueError("chat and text prompts need their rendered bytes")
        n_tokens = len(prompt)
        keys = chain_bytes(chain_root(req.tenant), prompt, text_block_tokens)
        block_size = text_block_tokens
    return RouteRequest(
        request_id=req.request_id,
        pool=pool,
        tenant=req.tenant,
        namespace=req.tenant,
        block_keys=tuple(BlockKey(k) for k in keys),
        n_prompt_tokens=n_tokens,
        block_size_tokens=block_size,
        isolation=Isolation.STRICT,
        max_output_tokens=req.max_output_tokens,
        session_key=req.session or None,
    )
