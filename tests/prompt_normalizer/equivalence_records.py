"""A canonical, keyed digest of every normalizer output, and the run of one corpus case.

Every field of a `CanonicalPrompt` (or the render plan, or the error's message, param and code) is
serialized in a fixed order, so any change in behaviour changes a digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import orjson

from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.normalizer import Normalizer
from prompt_normalizer.render import RenderPlan
from prompt_normalizer.types import CanonicalPrompt
from tests.prompt_normalizer.equivalence_corpus import IDENTITIES, PUBLIC, Case

# Digests of test outputs only; keyed anyway, like every digest the project keeps.
_DIGEST_KEY = b"kvgate-equivalence-goldens"


def prompt_record(prompt: CanonicalPrompt) -> Any:
    """Every field of a `CanonicalPrompt` in a fixed order, with types (key order of the body kept)."""
    drift = prompt.drift
    return [
        "prompt",
        prompt.n_tokens,
        prompt.block_size_tokens,
        list(prompt.block_keys),
        [[z.zone.value, z.source, z.start_token, z.end_token] for z in prompt.zones],
        list(prompt.public_block_keys),
        list(prompt.diagnostics),
        prompt.canonical_body,
        None
        if drift is None
        else [
            drift.session_seen,
            drift.first_diff_block,
            drift.shared_blocks,
            drift.previous_blocks,
            None if drift.zone is None else drift.zone.value,
            drift.field,
        ],
        prompt.immutable_blocks,
        [type(prompt.block_keys).__name__, type(prompt.zones).__name__, type(prompt.diagnostics).__name__],
    ]


def plan_record(plan: RenderPlan) -> Any:
    return [
        "plan",
        plan.endpoint,
        plan.render_path,
        plan.body,
        [[s.purpose, s.n_messages, s.with_tools] for s in plan.boundary_specs],
        list(plan.boundary_bodies),
    ]


def error_record(exc: NormalizerError) -> Any:
    return ["error", str(exc), exc.param, exc.code]


def digest(record: Any) -> str:
    data = orjson.dumps(record)
    return hashlib.blake2b(data, key=_DIGEST_KEY, digest_size=4).hexdigest()


def _fake_render_ids(body: Any) -> list[int]:
    """Deterministic stand-in for a worker's render: a boundary body renders to a prefix of the
    full body's ids exactly where the serialization shares a prefix."""
    parts = [body.get("tools"), body.get("messages")]
    return list(orjson.dumps(parts))[::2]


def run_case(norm: Normalizer, case: Case) -> Iterator[Any]:
    """The records of one case: a prompt or an error (render mode: the plan, then the prompt)."""
    ident = IDENTITIES[case.identity]
    public = PUBLIC[case.identity] if case.public else None
    try:
        if norm.config.mode == "render" and case.endpoint == "chat":
            plan = norm.prepare_render("chat", case.body)
            yield plan_record(plan)
            boundaries = [None if b is None else _fake_render_ids(b) for b in plan.boundary_bodies]
            prompt = norm.from_render(
                plan,
                _fake_render_ids(plan.body),
                ident,
                public,
                boundary_token_ids=boundaries,
                session_key=case.session_key,
            )
        else:
            prompt = norm.canonicalize(
                case.endpoint,  # type: ignore[arg-type]
                case.body,
                ident,
                public,
                session_key=case.session_key,
            )
        yield prompt_record(prompt)
    except NormalizerError as exc:
        yield error_record(exc)
