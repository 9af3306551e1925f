"""A large JSON body read, checked and keyed in a keying process, and handed back in pieces.

Parsing a body of several megabytes (`orjson.loads`), encoding it and keying it are each long
calls that hold the GIL, so on the gateway's own process they stop its event loop for up to a few
hundred milliseconds, whether they run on the loop or on a thread. `key_body` does all of it in a
keying process (`gateway.keying_pool`) with the same functions admission runs (`parse_body`,
`encode_body`, `Normalizer.canonicalize`), and answers with what the loop needs: the encoded body
(bytes), the keys and zones (numbers), the drift observation (digests, `PendingDrift`), and the
parsed body as `Piece`s of at most about `PIECE_BYTES` of JSON each, which the loop turns back
into the same objects a few at a time (`gateway.keying_pool.rebuild`). Nothing here logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.bodies import encode_body, parse_body
from gateway.errors import ApiError
from gateway.routes import ROUTES
from prompt_normalizer.errors import NormalizerError
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.sessions import PendingDrift
from prompt_normalizer.types import CanonicalPrompt, KeyIdentity

# The most JSON one piece holds (unless one string is longer): parsing it takes about a
# millisecond, so the loop gets a turn at least that often while it rebuilds a body.
PIECE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Whole:
    """A value, as JSON."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Text:
    """A string too long for one piece, as consecutive slices (each a JSON string)."""

    slices: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive members of an object (a JSON object) or items of an array (a JSON array)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Member:
    """One member of an object whose value is too large for one piece."""

    name: str
    value: Piece


@dataclass(frozen=True, slots=True)
class Container:
    """An object (`is_object`) or array too large for one piece, in order."""

    is_object: bool
    parts: tuple[Run | Member | Whole | Text | Container, ...]


Piece = Whole | Text | Container


def pieces(value: Any, encoded: bytes | None = None) -> Piece:
    """`value` (a parsed JSON value) as pieces that parse back to an equal value, its members and
    items in order."""
    data = orjson.dumps(value) if encoded is None else encoded
    if len(data) > PIECE_BYTES and isinstance(value, str):
        step = max(1, PIECE_BYTES // 4)  # at most 4 bytes of UTF-8 a character: 64 KiB a slice
        return Text(tuple(orjson.dumps(value[i : i + step]) for i in range(0, len(value), step)))
    if len(data) <= PIECE_BYTES or not isinstance(value, dict | list):
        return Whole(data)
    parts: list[Run | Member | Whole | Text | Container] = []
    run: list[bytes] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if run:
            open_, close = (b"{", b"}") if isinstance(value, dict) else (b"[", b"]")
            parts.append(Run(open_ + b",".join(run) + close))
            run.clear()
            size = 0

    members = value.items() if isinstance(value, dict) else ((None, item) for item in value)
    for name, item in members:
        item_data = orjson.dumps(item)
        if len(item_data) > PIECE_BYTES:
            flush()
            piece = pieces(item, item_data)
            parts.append(piece if name is None else Member(name, piece))
            continue
        run.append(item_data if name is None else orjson.dumps(name) + b":" + item_data)
        size += len(item_data)
        if size >= PIECE_BYTES:
            flush()
    flush()
    return Container(isinstance(value, dict), tuple(parts))


@dataclass(frozen=True, slots=True)
class ModelKeying:
    """What keying one model's requests takes, for a model whose pool keys in approximate mode."""

    config: NormalizerConfig
    identity: KeyIdentity
    public: KeyIdentity | None


@dataclass(frozen=True, slots=True)
class BodyJob:
    """One large JSON body to read and key: `path` names its route (`gateway.routes.ROUTES`);
    `max_choices` and `max_pooling_inputs` are the limits it is read within (`limits.*`);
    `models` are the models it may be keyed for, under the tenant's identities; `only_model` the
    model of a body that names none (when the gateway serves one)."""

    raw: bytes
    path: str
    max_choices: int
    secret: bytes
    models: Mapping[str, ModelKeying]
    only_model: str | None
    max_pooling_inputs: int = 2048


@dataclass(frozen=True, slots=True)
class KeyedBody:
    """The answer for a `BodyJob`. `error` (status, message, type, code, param) is the 400 the
    body gets, instead of everything else. `path` is the route the body picked. `canonical` is set
    when the body's model (`model`) was in the job's `models`, without its canonical body (that is
    `canonical_body`, in pieces) and with the drift still to observe (`pending`); else
    `prompt_error` (message, code, param) may say why the normalizer refused it."""

    error: tuple[int, str, str, str | None, str | None] | None = None
    path: str = ""
    model: str | None = None
    encoded: bytes = b""
    body: Piece | None = None
    canonical: CanonicalPrompt | None = None
    canonical_body: Piece | None = None
    pending: PendingDrift | None = None
    prompt_error: tuple[str, str, str | None] | None = None


# The keying process's normalizers, one per config and secret, kept across jobs so that their
# caches (chain roots, remembered immutable spans) serve the next large body too.
_normalizers: dict[tuple[NormalizerConfig, bytes], Normalizer] = {}


def _normalizer(config: NormalizerConfig, secret: bytes) -> Normalizer:
    found = _normalizers.get((config, secret))
    if found is None:
        if len(_normalizers) >= 16:
            _normalizers.clear()  # reloaded configs: keep only what is used now
        found = _normalizers[(config, secret)] = Normalizer(config, secret, defer_drift=True)
    return found


def key_body(job: BodyJob) -> KeyedBody:
    """Read, check and key one body as admission does (runs in a keying process)."""
    api = ROUTES[job.path]
    try:
        body = parse_body(job.raw, api, job.max_choices, job.max_pooling_inputs)
        if api.pick is not None:
            api = api.pick(body)
        encoded = encode_body(body)
    except ApiError as exc:
        return KeyedBody(error=(exc.status, exc.message, exc.type, exc.code, exc.param))
    model = body.get("model") or job.only_model
    keying = job.models.get(model) if isinstance(model, str) else None
    out = KeyedBody(path=api.path, encoded=encoded, body=pieces(body, encoded))
    if keying is None or api.prompt is None or not isinstance(model, str):
        return out
    out = dataclasses.replace(out, model=model)
    normalizer = _normalizer(keying.config, job.secret)
    normalizer.take_pending_drift()
    try:
        canonical = normalizer.canonicalize(api.prompt, body, keying.identity, keying.public)
    except NormalizerError as exc:
        return dataclasses.replace(out, prompt_error=(exc.message, exc.code, exc.param))
    rewritten = canonical.canonical_body
    return dataclasses.replace(
        out,
        canonical=dataclasses.replace(canonical, canonical_body=None),
        canonical_body=None if rewritten is None else pieces(rewritten),
        pending=normalizer.take_pending_drift(),
    )
