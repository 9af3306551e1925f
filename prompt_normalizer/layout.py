"""From a rendered model input and its zone boundaries to a `CanonicalPrompt`.

Every mode ends here: it supplies the bytes to hash (token ids or canonical text), how many bytes
one token takes, the token count, and the token positions of the zone boundaries. Boundaries are
measured by rendering a prefix of the conversation (`BoundarySpec`) and taking the longest common
prefix with the full rendering, so a template that is not prefix-stable only makes a zone shorter,
never wrong.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from prompt_normalizer.canonical import CanonicalChat
from prompt_normalizer.keys import Bytes, PrefixKeyMemo, byte_view, chain_keys, chain_view
from prompt_normalizer.roots import UnitRoots
from prompt_normalizer.types import BlockKey, CanonicalPrompt, DriftReport, Zone, ZoneSpan

# The codec function itself: `str.encode("utf-32-le")` first looks the codec up by name, which
# costs more than encoding a short tail.
_utf32le = codecs.utf_32_le_encode

# Below this many immutable blocks, hashing them is as cheap as looking them up.
MEMO_MIN_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class BoundarySpec:
    """A prefix rendering that ends a zone: `messages[:n_messages]`, with or without the tools,
    no generation prompt. `purpose` is `immutable_end`, `stable_end` or `media:<message index>`."""

    purpose: str
    n_messages: int
    with_tools: bool


@dataclass(slots=True)
class Boundaries:
    """Token positions of the zone boundaries (`None` when a boundary could not be measured).

    Read-only once built, like `Hashed`: both are built on every request and never leave the
    normalizer, where a frozen dataclass would cost ~110 ns a field to build.
    """

    immutable_end: int | None
    stable_end: int | None
    media_starts: Mapping[int, int | None]


def boundary_specs(chat: CanonicalChat) -> tuple[BoundarySpec, ...]:
    """The prefix renderings a chat request needs for its zone spans and media positions."""
    specs = [BoundarySpec("immutable_end", chat.n_immutable, chat.tools_immutable and chat.tools is not None)]
    stable = chat.volatile_index if chat.volatile_index is not None else len(chat.messages)
    if chat.volatile_index is not None or chat.add_generation_prompt:
        specs.append(BoundarySpec("stable_end", stable, chat.tools is not None))
    for index in sorted({m.message_index for m in chat.media}):
        specs.append(BoundarySpec(f"media:{index}", index, chat.tools is not None))
    return tuple(specs)


def boundary_body(body: Mapping[str, Any], spec: BoundarySpec) -> dict[str, Any] | None:
    """The render request for one boundary (None when it is trivially token 0)."""
    if spec.n_messages == 0 and not spec.with_tools:
        return None
    out = dict(body)
    out["messages"] = list(body["messages"])[: spec.n_messages]
    if not spec.with_tools:
        out.pop("tools", None)
        out.pop("tool_choice", None)
    out["add_generation_prompt"] = False
    out["continue_final_message"] = False
    out.pop("stream", None)
    out.pop("stream_options", None)
    return out


def common_prefix_tokens(a: npt.NDArray[np.uint32], b: npt.NDArray[np.uint32]) -> int:
    """Length of the longest common prefix of two token arrays (vectorized)."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def common_prefix_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (C-speed slice compares)."""
    if a.startswith(b):
        return len(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def boundaries_from_positions(
    specs: tuple[BoundarySpec, ...],
    positions: list[int | None],
    n_tokens: int,
    add_generation_prompt: bool,
    volatile: bool,
) -> Boundaries:
    found = dict(zip((s.purpose for s in specs), positions, strict=True))
    stable = found.get("stable_end", n_tokens) if (volatile or add_generation_prompt) else n_tokens
    media = {int(p.split(":", 1)[1]): pos for p, pos in found.items() if p.startswith("media:")}
    return Boundaries(found.get("immutable_end"), stable, media)


@dataclass(slots=True)
class Hashed:
    """What one mode hands to `assemble`: the bytes and how they map to tokens.

    Approximate mode hands its canonical text instead (`text`, with `data` None): its bytes are
    the text in UTF-32-LE, and `assemble` encodes only the part it hashes; a remembered
    immutable head is found by a fingerprint of its text.
    """

    data: Bytes | None
    bytes_per_token: int
    n_tokens: int
    text: str | None = None

    def view(self, start_byte: int, end_byte: int) -> bytes | memoryview:
        """The bytes `[start_byte, end_byte)`, flat (text is encoded to plain bytes, which
        `chain_view` slices a little faster than a view)."""
        if self.text is not None:  # 4 bytes a character
            encoded: bytes = _utf32le(self.text[start_byte // 4 : end_byte // 4])[0]
            return encoded
        assert self.data is not None
        data = self.data
        return (memoryview(data) if type(data) is bytes else byte_view(data))[start_byte:end_byte]


# What `assemble` asks of drift tracking when the request has a session: the report for these
# keys, the end of the stable content and the zones.
DriftObserver = Callable[[tuple[BlockKey, ...], int, tuple[ZoneSpan, ...]], DriftReport]


def drift_line(drift: DriftReport) -> str:
    """The diagnostic a drifted request carries, naming the block, zone and field."""
    return f"drift: block {drift.first_diff_block} ({drift.zone}, {drift.field})"


# One `CanonicalPrompt` per request. Its frozen dataclass __init__ stores each of its eight fields
# through `object.__setattr__` (about 1.1 µs in all); the slot descriptors' own setters store the
# same values in half that. The field order is checked here, so a field added to the type fails
# loudly at import instead of being left unset.
_PROMPT_FIELDS = (
    "n_tokens",
    "block_size_tokens",
    "block_keys",
    "zones",
    "public_block_keys",
    "diagnostics",
    "canonical_body",
    "drift",
)
if tuple(f.name for f in dataclasses.fields(CanonicalPrompt)) != _PROMPT_FIELDS:
    raise TypeError("CanonicalPrompt fields changed: update layout.new_prompt")
(
    _set_n_tokens,
    _set_block_size,
    _set_block_keys,
    _set_zones,
    _set_public_keys,
    _set_diagnostics,
    _set_body,
    _set_drift,
) = (getattr(CanonicalPrompt, name).__set__ for name in _PROMPT_FIELDS)


def new_prompt(
    n_tokens: int,
    block_size_tokens: int,
    block_keys: tuple[BlockKey, ...],
    zones: tuple[ZoneSpan, ...],
    public_block_keys: tuple[BlockKey, ...],
    diagnostics: tuple[str, ...],
    canonical_body: Mapping[str, Any] | None,
    drift: DriftReport | None,
) -> CanonicalPrompt:
    """`CanonicalPrompt(...)` with the same arguments, built in half the time."""
    prompt: CanonicalPrompt = object.__new__(CanonicalPrompt)
    _set_n_tokens(prompt, n_tokens)
    _set_block_size(prompt, block_size_tokens)
    _set_block_keys(prompt, block_keys)
    _set_zones(prompt, zones)
    _set_public_keys(prompt, public_block_keys)
    _set_diagnostics(prompt, diagnostics)
    _set_body(prompt, canonical_body)
    _set_drift(prompt, drift)
    return prompt


@functools.lru_cache(maxsize=4096)
def _zone_spans(
    n: int,
    imm_end: int,
    stable: int,
    volatile: bool,
    source: str,
    n_immutable: int,
    tools_in_immutable: bool,
    n_messages: int,
    volatile_index: int | None,
) -> tuple[ZoneSpan, ...]:
    """The zone spans (shared, immutable objects: the same few shapes recur request after request)."""
    if not n_messages:  # a completions prompt: one append-only span
        return (ZoneSpan(Zone.APPEND_ONLY, source, 0, n),)
    zones: list[ZoneSpan] = []
    if imm_end > 0:
        imm_src = f"messages[0:{n_immutable}]" + ("+tools" if tools_in_immutable else "")
        zones.append(ZoneSpan(Zone.IMMUTABLE, imm_src, 0, imm_end))
    last = volatile_index if volatile_index is not None else n_messages
    end_append = stable if volatile else n
    first = n_immutable if imm_end > 0 else 0  # an unmeasured immutable zone joins the log
    if end_append > imm_end:
        zones.append(ZoneSpan(Zone.APPEND_ONLY, f"messages[{first}:{last}]", imm_end, end_append))
    if volatile and n > stable:
        zones.append(ZoneSpan(Zone.VOLATILE, f"messages[{volatile_index}]", stable, n))
    return tuple(zones)


def _head_fingerprint(hashed: Hashed, head_bytes: int, memo: PrefixKeyMemo) -> int:
    """The memory's fingerprint of the leading `head_bytes`. Text is fingerprinted as UTF-8: as
    exact as its UTF-32 and a quarter of the bytes for ASCII, so approximate mode encodes a
    remembered head to UTF-32 only on a miss. (Text that UTF-8 cannot encode, lone surrogates,
    fails UTF-32 the same way; chat text never has them: orjson refused it earlier.)"""
    if hashed.text is not None:
        return memo.fingerprint(hashed.text[: head_bytes // 4].encode())
    return memo.fingerprint(hashed.view(0, head_bytes))


def _head_keys(
    hashed: Hashed, head_bytes: int, block_bytes: int, seed: int, fingerprint: int, memo: PrefixKeyMemo
) -> tuple[BlockKey, ...]:
    """The keys of the leading `head_bytes` chained from `seed`, from memory when seen before."""
    keys = memo.get(seed, head_bytes, fingerprint)
    if keys is None:
        keys = chain_view(hashed.view(0, head_bytes), block_bytes, seed)
        memo.put(seed, head_bytes, fingerprint, keys)
    return keys


def assemble(
    hashed: Hashed,
    block_size: int,
    roots: UnitRoots,
    boundaries: Boundaries,
    chat: CanonicalChat | None,
    source: str,
    diagnostics: list[str],
    memo: PrefixKeyMemo | None = None,
    observe_drift: DriftObserver | None = None,
) -> CanonicalPrompt:
    """Zone spans, chained keys (media folded in), public keys of the leading immutable blocks.
    Problems with the boundaries are appended to `diagnostics`."""
    n = hashed.n_tokens
    # Conditional expressions instead of min()/max() here: builtin calls cost ~100 ns each.
    imm_end = boundaries.immutable_end or 0
    imm_end = imm_end if imm_end < n else n
    if boundaries.immutable_end is None and chat is not None and chat.n_immutable:
        diagnostics.append("zones: immutable boundary not measured; immutable zone left empty")
    stable = boundaries.stable_end
    volatile = chat is not None and chat.volatile_index is not None
    if stable is None:
        # Without it the generation prompt counts as stable content (drift may then flag the tail).
        if volatile:
            diagnostics.append("zones: stable boundary not measured; no volatile span")
        stable, volatile = n, False
    stable = stable if stable < n else n
    stable = stable if stable > imm_end else imm_end
    extras: dict[int, bytes] = {}
    if chat is not None and chat.media:
        # Joined once per block: appending each digest to the block's bytes would copy them
        # again for every media item of a message (quadratic in a request's images).
        digests: dict[int, list[bytes]] = {}
        for item in chat.media:
            start = boundaries.media_starts.get(item.message_index)
            block = 0 if start is None else min(start, n) // block_size
            digests.setdefault(block, []).append(item.digest)
        extras = {block: b"".join(parts) for block, parts in digests.items()}
    if chat is None:
        zones = _zone_spans(n, 0, n, False, source, 0, False, 0, None)
    else:
        zones = _zone_spans(
            n,
            imm_end,
            stable,
            volatile,
            source,
            chat.n_immutable,
            bool(chat.tools) and chat.tools_immutable,
            len(chat.messages),
            chat.volatile_index,
        )
    block_bytes = block_size * hashed.bytes_per_token
    end = n // block_size * block_bytes
    public: tuple[BlockKey, ...] = ()
    n_public = imm_end // block_size
    if memo is not None and not extras and n_public >= MEMO_MIN_BLOCKS:
        # The immutable blocks repeat across requests: their keys (and public keys) from memory.
        head_bytes = n_public * block_bytes
        fingerprint = _head_fingerprint(hashed, head_bytes, memo)
        head = _head_keys(hashed, head_bytes, block_bytes, roots.root, fingerprint, memo)
        keys = head + chain_view(hashed.view(head_bytes, end), block_bytes, head[-1])
        if roots.public_root is not None:
            public = _head_keys(hashed, head_bytes, block_bytes, roots.public_root, fingerprint, memo)
    else:
        view = hashed.view(0, end)
        keys = chain_keys(view, block_bytes, roots.root, extras)
        if roots.public_root is not None and n_public:
            public = chain_keys(view[: n_public * block_bytes], block_bytes, roots.public_root, extras)
    drift = None
    if observe_drift is not None:
        drift = observe_drift(keys, stable, zones)
        if drift.first_diff_block is not None:
            diagnostics.append(drift_line(drift))
    body = chat.body if chat is not None else None
    return new_prompt(n, block_size, keys, zones, public, tuple(diagnostics), body, drift)
