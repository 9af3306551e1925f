"""Render mode: the worker's `/v1/chat/completions/render` (or `/v1/completions/render`) gives the
token ids; the gateway does the HTTP calls and the normalizer stays pure.

    plan = normalizer.prepare_render("chat", body)
    POST plan.render_path  with plan.body              -> token ids of the full prompt
    POST plan.render_path  with each plan.boundary_bodies[i] (optional, concurrent; skip None)
    prompt = normalizer.from_render(plan, token_ids, identity, boundary_token_ids=[...])
    forward plan.body upstream (it is what the keys describe)

`parse_render_token_ids` accepts the shapes vLLM and compatible workers return:
`{"token_ids": [...]}` (chat) and `[{"token_ids": [...]}]` (completions); `prompt_token_ids` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prompt_normalizer.canonical import CanonicalChat
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.keys import TokenArray, as_tokens
from prompt_normalizer.layout import BoundarySpec, common_prefix_tokens

CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETIONS_RENDER_PATH = "/v1/completions/render"


@dataclass(frozen=True, slots=True)
class RenderPlan:
    """What the gateway must render for one request, and the canonical form to forward.

    `boundary_bodies[i]` renders the prefix that ends a zone (`boundary_specs[i]`); `None` means the
    boundary is token 0 and needs no call. A boundary whose render fails or is skipped may be passed
    as `None` to `from_render`: its zone is then measured conservatively (see docs/normalizer.md).
    """

    endpoint: Literal["chat", "completions"]
    render_path: str
    body: Mapping[str, Any]
    boundary_specs: tuple[BoundarySpec, ...]
    boundary_bodies: tuple[Mapping[str, Any] | None, ...]
    chat: CanonicalChat | None


def parse_render_token_ids(payload: Any) -> TokenArray:
    """Token ids from a render response body (already JSON-decoded); NormalizerError if malformed."""
    item = payload
    if isinstance(item, list):
        if not item:
            raise NormalizerError("render response is an empty list", param="render", code="bad_render")
        item = item[0]
    if isinstance(item, Mapping):
        ids = item.get("token_ids", item.get("prompt_token_ids"))
        if isinstance(ids, list):
            return as_tokens(ids, param="render.token_ids")
    raise NormalizerError("render response has no 'token_ids' list", param="render", code="bad_render")


def render_boundaries(
    full: TokenArray,
    boundary_tokens: Sequence[Sequence[int] | TokenArray | None],
    specs: Sequence[BoundarySpec],
) -> list[int | None]:
    """Boundary positions: longest common token prefix of each boundary render with the full one."""
    out: list[int | None] = []
    padded = list(boundary_tokens) + [None] * (len(specs) - len(boundary_tokens))
    for spec, ids in zip(specs, padded, strict=False):
        if spec.n_messages == 0 and not spec.with_tools:
            out.append(0)
        elif ids is None:
            out.append(None)
        else:
            out.append(common_prefix_tokens(full, as_tokens(ids, param="render.token_ids")))
    return out
