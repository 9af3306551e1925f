"""The wire format of one sync batch: msgpack, keys and counts only, sealed (`signing`).

    {"o": origin, "s": seq, "t": sent (wall clock, s), "f": full load snapshot,
     "p": [pool names], "n": [namespaces], "w": [worker ids],      # string tables
     "i": [[0, ref, pool, block size, namespace, worker, n keys, prompt tokens, matched tokens]
           | [1, ref, served], ...],                             # holdings and outcomes, in order
     "k": <every holding's keys, u64 little-endian, in item order>,
     "l": [[pool, worker, requests, prefill tokens, decode tokens], ...],
     "c": [[pool, block size, prompt tokens, request tokens, prefill time ratio], ...],  # optional
     "x": [decode context tokens, ...],                          # optional, one per "l" entry
     "y": [prefill attention pairs, ...],                        # optional, one per "l" entry
     "a": seconds its oldest item waited in the sender's queue,  # optional
     "d": [pool fingerprint, ...],                               # optional, one per pool of the sender
     "u": [[tenant, requests, tokens, in flight], ...]}          # optional

"c" carries calibration samples (`PeerCalibration`), "x" each load's decode context
(`PeerLoad.decode_context_tokens`), "y" each load's prefill attention (`PeerLoad.prefill_pairs`),
"a" how long before "t" the batch's first item was queued (on the sender's monotonic clock: when its
items were decided, for `policies.herd`), "d" the fingerprint of each pool the sender routes to
(`gateway.sync.deployment`: which deployment it is part of), "u" what the sender charged to its
tenants' quotas since its last batch and their requests in flight there (`quotas.Usage`, one row a
tenant with quotas whose figures changed, or with requests in flight in a full snapshot). All six
were added within version 1 as optional fields, because a reader takes the fields it knows by name
and skips the others: a gateway of an earlier version-1 release ignored them (and kept routing on
the holdings and loads of the same batch), and fields added within version 2 can be too. A batch
without "c" has no samples; one without "x" or "y" has loads whose decode context or prefill
attention is 0 (its writer did not count it); one without "a" had no item wait (or its writer did
not say); one without "d" does not say which pools its sender has (`SyncBatch.pools` is None).
Samples are independent of the items' order, so they travel after them.

Pools, namespaces and workers are indices into the string tables. A namespace is the tenant's index
namespace (`tenant:<name>`, or the public one), a key a keyed chain hash: nothing in a batch is
prompt content, and a key cannot be turned back into text without the deployment's secret. Anything
that does not decode to exactly this shape is `MalformedBatch`, and so is a batch beyond what a
gateway publishes: more than `MAX_BATCH_KEYS` keys, `MAX_BATCH_ITEMS` items or samples,
`MAX_BATCH_LOADS` loads, `MAX_BATCH_TENANTS` quota rows or `MAX_BATCH_NAMES` names in a table, a
string (an origin or a name) of more than `MAX_NAME_BYTES`, a prompt of more than
`MAX_PROMPT_TOKENS`, or a send time that is not finite. A batch otherwise well formed whose send
time is further than `MAX_CLOCK_SKEW_S` from the receiver's wall clock (it feeds the lag metric and
the decision times of `policies.herd`) is `ClockSkewed`, a `MalformedBatch` of its own.

The map is the body of a sealed batch (`signing`: a header naming the version, then the map,
then an HMAC tag over both under a key derived from the deployment's key-hash secret), and a
receiver verifies the tag before it reads anything of the map: a batch that was not sealed under
this deployment's key is `BadSignature`, a `MalformedBatch` of its own. Version 2 is version 1's
map, without its "v" field (the header says it), sealed; the two do not read each other (an earlier
release refuses a sealed batch at its first byte as malformed).

A batch is read by its containers' headers, their counts checked first (`wire_read`).
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from gateway.quotas import Usage
from gateway.sync.signing import WIRE_VERSION as WIRE_VERSION
from gateway.sync.signing import BadSignature as BadSignature
from gateway.sync.signing import BatchKey
from gateway.sync.wire_read import MalformedBatch as MalformedBatch  # its errors' type, re-exported
from gateway.sync.wire_read import read_map
from policies.base import WorkerId
from policies.peer_sync import PeerCalibration, PeerHolding, PeerItem, PeerLoad, PeerOutcome
from prompt_normalizer.types import BlockKey

_HOLDING, _OUTCOME = 0, 1
_MAX_BYTES = 8 * 1024 * 1024  # a sealed batch, its header and tag included
MAX_WAIT_S = 3600.0  # an item's wait in its sender's queue ("a"), at most (a publisher says no more)
# Keys one batch may carry: twice what a publisher puts in one (`PUBLISH_BATCH_KEYS`, the keys a
# batch under NATS's default 1 MiB `max_payload` could ever hold), so every gateway's batches pass.
PUBLISH_BATCH_KEYS = 131_072
MAX_BATCH_KEYS = 2 * PUBLISH_BATCH_KEYS
# Items one batch may carry, and calibration samples: twice what a publisher puts in one.
PUBLISH_BATCH_ITEMS = 8192
MAX_BATCH_ITEMS = 2 * PUBLISH_BATCH_ITEMS
# Load rows one batch may carry: one per worker of the sender's registry, far beyond any fleet
# (65,536 rows took half a second of the loop to decode); and names in each string table (pools,
# namespaces, workers: each one an item's or a load's).
MAX_BATCH_LOADS = 16_384
MAX_BATCH_NAMES = MAX_BATCH_ITEMS + MAX_BATCH_LOADS
# Pool fingerprints one batch may carry ("d"): four times the pools a policy keeps (`PoolSet.MAX_POOLS`).
MAX_BATCH_POOLS = 1024
# Tenants' quota rows one batch may carry ("u"): twice what a publisher puts in one. A row's
# requests and requests in flight are at most `MAX_USAGE_COUNT`, its tokens at most
# `MAX_USAGE_TOKENS` (all non-negative): beyond what a gateway charges between two batches.
PUBLISH_BATCH_TENANTS = 2048
MAX_BATCH_TENANTS = 2 * PUBLISH_BATCH_TENANTS
MAX_USAGE_COUNT = 1 << 32
MAX_USAGE_TOKENS = 1 << 40
_MAX_FIELDS = 32  # a batch's top-level map: 15 fields today, room for later releases' own
_MAX_ROW = 16  # entries of one item, load or sample row (9 at most today)
# UTF-8 bytes of one string: the origin, a pool, namespace or worker name. Peers keep these (a
# peer's name with its load, a namespace with every index entry of its holdings), so their
# length is what a made-up one costs: an origin is `host:pid:random`, a worker a URL, a
# namespace `tenant:<name>`, all far shorter.
MAX_NAME_BYTES = 1024
# Tokens of one prompt (a holding's prompt and matched tokens, a sample's prompt and request
# tokens): beyond any context window and far beyond what a gateway's body limit lets in. A peer
# charges a holding's prompt to its worker as prefill work that decays over minutes, so this is
# the most a made-up one can charge (2**64 tokens was 2e29 s: the worker shunned for hours).
MAX_PROMPT_TOKENS = 1 << 24
# The containers of a batch, by field: a flat list of at most this many scalars, or that many
# rows of scalars. Any other field is a scalar or a later release's field (skipped unread).
_LISTS = {"p": MAX_BATCH_NAMES, "n": MAX_BATCH_NAMES, "w": MAX_BATCH_NAMES}
_LISTS |= {"x": MAX_BATCH_LOADS, "y": MAX_BATCH_LOADS, "d": MAX_BATCH_POOLS}
_ROWS = {"i": MAX_BATCH_ITEMS, "c": MAX_BATCH_ITEMS, "l": MAX_BATCH_LOADS, "u": MAX_BATCH_TENANTS}
_KNOWN_SCALARS = frozenset("ostfka")
# How far a batch's send time may be from the receiver's wall clock, either way: far beyond the
# skew of hosts that keep time and any wait in the broker, well short of a clock that is broken.
MAX_CLOCK_SKEW_S = 600.0


class ClockSkewed(MalformedBatch):
    """A batch of the right shape whose send time is finite but further than `MAX_CLOCK_SKEW_S`
    from the receiver's wall clock: the sender's clock, or the receiver's, is off. Its own type so
    that an operator can tell a broken clock from a broken peer. `skew_s`: send time less the
    receiver's wall clock."""

    def __init__(self, origin: str, skew_s: float) -> None:
        super().__init__("send time not within the clock skew allowed")
        self.origin = origin
        self.skew_s = skew_s


@dataclass(frozen=True, slots=True)
class SyncBatch:
    """What one gateway publishes at once. `full_load`: `loads` is its whole in-flight load (a
    worker it leaves out is idle); otherwise only the workers whose load changed. `seq` numbers
    the origin's batches from 1, one more each batch. `pools`: the fingerprints of the pools the
    origin routes to (`gateway.sync.deployment`); None when its release does not send them.
    `usage`: its tenants' quota figures (`quotas.Usage`), by tenant name."""

    origin: str
    seq: int
    sent_wall_s: float
    full_load: bool
    items: tuple[PeerItem, ...] = ()
    loads: tuple[PeerLoad, ...] = ()
    waited_s: float = 0.0  # how long the first item waited in the sender's queue before `sent_wall_s`
    pools: tuple[int, ...] | None = None
    usage: tuple[tuple[str, Usage], ...] = ()


class _Table:
    __slots__ = ("index", "names")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
        return i


def encode(batch: SyncBatch, key: BatchKey) -> bytes:
    """`batch` on the wire: its body (`encode_body`) sealed under `key`."""
    return key.seal(encode_body(batch))


def encode_body(batch: SyncBatch) -> bytes:
    """The msgpack map of `batch`, unsealed: what `signing` seals."""
    pools, namespaces, workers = _Table(), _Table(), _Table()
    items: list[list[Any]] = []
    samples: list[list[Any]] = []
    keys: list[int] = []
    for item in batch.items:
        if isinstance(item, PeerCalibration):
            samples.append(
                [
                    pools(item.pool), item.block_size_tokens, item.prompt_tokens, item.request_tokens,
                    float(item.scale_ratio),
                ]
            )  # fmt: skip
        elif isinstance(item, PeerHolding):
            items.append(
                [
                    _HOLDING, item.ref, pools(item.pool), item.block_size_tokens,
                    namespaces(item.namespace), workers(item.worker), len(item.keys),
                    item.n_prompt_tokens, item.matched_tokens,
                ]
            )  # fmt: skip
            keys.extend(item.keys)
        else:
            items.append([_OUTCOME, item.ref, item.served])
    loads = [
        [pools(x.pool), workers(x.worker), x.requests, x.prefill_tokens, x.decode_tokens] for x in batch.loads
    ]
    doc: dict[str, Any] = {
        "o": batch.origin,
        "s": batch.seq,
        "t": batch.sent_wall_s,
        "f": batch.full_load,
        "p": pools.names,
        "n": namespaces.names,
        "w": workers.names,
        "i": items,
        "k": struct.pack(f"<{len(keys)}Q", *keys),
        "l": loads,
    }
    if samples:
        doc["c"] = samples
    contexts = [x.decode_context_tokens for x in batch.loads]
    if any(contexts):
        doc["x"] = contexts
    pairs = [x.prefill_pairs for x in batch.loads]
    if any(pairs):
        doc["y"] = pairs
    if batch.waited_s > 0:
        doc["a"] = batch.waited_s
    if batch.pools is not None:
        doc["d"] = list(batch.pools)
    if batch.usage:
        doc["u"] = [[tenant, u.requests, u.tokens, u.in_flight] for tenant, u in batch.usage]
    return msgpack.packb(doc, use_bin_type=True)


def decode(data: bytes, key: BatchKey, now_wall_s: float | None = None) -> SyncBatch:
    """Parse one batch received at `now_wall_s` (default: now, `time.time()`) once its seal
    verifies under `key`; raises `BadSignature` for a batch not sealed under it (before anything
    of it is read), `MalformedBatch` for anything else (never another exception)."""
    if len(data) > _MAX_BYTES:
        raise MalformedBatch("batch too large")
    return decode_body(key.open(data), now_wall_s)


def decode_body(body: bytes | memoryview, now_wall_s: float | None = None) -> SyncBatch:
    """Parse the body of a batch whose seal was verified (`decode`: never call this on bytes
    received that were not)."""
    try:
        doc = _read(body)
        return _parse(doc, time.time() if now_wall_s is None else now_wall_s)
    except MalformedBatch:
        raise
    except (ValueError, TypeError, KeyError, IndexError, struct.error, msgpack.UnpackException) as exc:
        raise MalformedBatch(f"{type(exc).__name__}") from None


def _read(data: bytes | memoryview) -> dict[str, Any]:
    """The batch's top-level map, its lists and rows read by their headers (`wire_read`)."""
    return read_map(
        data,
        lists=_LISTS,
        rows=_ROWS,
        scalars=_KNOWN_SCALARS,
        max_fields=_MAX_FIELDS,
        max_row=_MAX_ROW,
        max_str=MAX_NAME_BYTES,
    )


def name_fits(name: str) -> bool:
    """Whether `name` is within `MAX_NAME_BYTES` encoded (peers refuse a batch with a longer one)."""
    return len(name) <= MAX_NAME_BYTES // 4 or len(name.encode()) <= MAX_NAME_BYTES


def item_fits(item: PeerItem) -> bool:
    """Whether peers accept `item`'s names and token counts (they refuse a batch that has one
    beyond `MAX_NAME_BYTES` or `MAX_PROMPT_TOKENS`)."""
    if isinstance(item, PeerHolding):
        return (
            item.n_prompt_tokens <= MAX_PROMPT_TOKENS
            and item.matched_tokens <= MAX_PROMPT_TOKENS
            and name_fits(item.pool)
            and name_fits(item.namespace)
            and name_fits(item.worker)
        )
    if isinstance(item, PeerCalibration):
        tokens = max(item.prompt_tokens, item.request_tokens)
        return tokens <= MAX_PROMPT_TOKENS and name_fits(item.pool)
    return True


def _per_load(doc: dict[str, Any], key: str, error: str) -> list[object] | None:
    """An optional list with one entry per load ("x", "y"); None when absent."""
    found = doc.get(key)
    if found is not None and (not isinstance(found, list) or len(found) != len(doc["l"])):
        raise MalformedBatch(error)
    return found


def _str(x: object) -> str:
    if not isinstance(x, str):
        raise MalformedBatch("expected a string")
    return x


def _int(x: object, low: int = 0) -> int:
    """A non-negative integer (at least `low`)."""
    if not isinstance(x, int) or isinstance(x, bool) or x < low:
        raise MalformedBatch("expected a non-negative integer")
    return x


def _tokens(x: object) -> int:
    """A prompt's token count (`MAX_PROMPT_TOKENS` at most)."""
    n = _int(x)
    if n > MAX_PROMPT_TOKENS:
        raise MalformedBatch("more tokens than any prompt has")
    return n


def _at(table: list[str], i: object) -> str:
    j = _int(i)
    if j >= len(table):
        raise MalformedBatch("string index out of range")
    return table[j]


def _strings(x: object) -> list[str]:
    if not isinstance(x, list):
        raise MalformedBatch("expected a list")
    return [_str(s) for s in x]


def _parse(doc: dict[str, Any], now_wall_s: float) -> SyncBatch:
    sent = doc["t"]
    if isinstance(sent, bool) or not isinstance(sent, float | int) or not isinstance(doc["f"], bool):
        raise MalformedBatch("bad header")
    if not math.isfinite(sent):
        raise MalformedBatch("send time not finite")
    pools, namespaces, workers = _strings(doc["p"]), _strings(doc["n"]), _strings(doc["w"])
    blob = doc["k"]
    if not isinstance(blob, bytes) or len(blob) % 8:
        raise MalformedBatch("keys must be u64 bytes")
    if len(blob) > 8 * MAX_BATCH_KEYS:
        raise MalformedBatch("more keys than any gateway publishes in one batch")
    all_keys = struct.unpack(f"<{len(blob) // 8}Q", blob)
    items: list[PeerItem] = []
    at = 0
    for raw in doc["i"]:
        if not isinstance(raw, list) or not raw:
            raise MalformedBatch("bad item")
        if raw[0] == _OUTCOME and len(raw) == 3 and isinstance(raw[2], bool):
            items.append(PeerOutcome(_int(raw[1]), raw[2]))
            continue
        if raw[0] != _HOLDING or len(raw) != 9:
            raise MalformedBatch("unknown item")
        n = _int(raw[6])
        if n < 0 or at + n > len(all_keys):
            raise MalformedBatch("keys out of range")
        keys = cast(tuple[BlockKey, ...], all_keys[at : at + n])
        at += n
        items.append(
            PeerHolding(
                _int(raw[1]), _at(pools, raw[2]), _int(raw[3], 1), _at(namespaces, raw[4]), keys,
                WorkerId(_at(workers, raw[5])), _tokens(raw[7]), _tokens(raw[8]),
            )
        )  # fmt: skip
    if at != len(all_keys):
        raise MalformedBatch("keys left over")
    contexts = _per_load(doc, "x", "bad decode contexts")
    pairs = _per_load(doc, "y", "bad prefill pairs")
    loads = []
    for k, raw in enumerate(doc["l"]):
        if not isinstance(raw, list) or len(raw) != 5:
            raise MalformedBatch("bad load")
        worker = WorkerId(_at(workers, raw[1]))
        context = 0 if contexts is None else _int(contexts[k])
        pair = 0 if pairs is None else _int(pairs[k])
        if 2 * pair > _int(raw[3]) ** 2:
            raise MalformedBatch("prefill pairs beyond what the prefill tokens can have")
        loads.append(
            PeerLoad(_at(pools, raw[0]), worker, _int(raw[2]), _int(raw[3]), _int(raw[4]), context, pair)
        )
    for raw in doc.get("c", ()):
        items.append(_sample(pools, raw))
    waited = doc.get("a", 0.0)
    if isinstance(waited, bool) or not isinstance(waited, float | int) or not 0 <= waited <= MAX_WAIT_S:
        raise MalformedBatch("bad item wait")
    marks = doc.get("d")
    fingerprints = None if marks is None else tuple(_fingerprint(x) for x in marks)
    usage = tuple(_usage(raw) for raw in doc.get("u", ()))
    origin = _str(doc["o"])
    seq = _int(doc["s"])
    if abs(float(sent) - now_wall_s) > MAX_CLOCK_SKEW_S:  # checked last: a broken batch is malformed
        raise ClockSkewed(origin, float(sent) - now_wall_s)
    return SyncBatch(
        origin, seq, float(sent), doc["f"], tuple(items), tuple(loads), float(waited), fingerprints, usage
    )


def _usage(raw: object) -> tuple[str, Usage]:
    """One tenant's quota row: its name, and figures within what a gateway sends."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise MalformedBatch("bad quota row")
    requests, tokens, in_flight = _int(raw[1]), _int(raw[2]), _int(raw[3])
    if tokens > MAX_USAGE_TOKENS:
        raise MalformedBatch("bad quota tokens")
    if requests > MAX_USAGE_COUNT or in_flight > MAX_USAGE_COUNT:
        raise MalformedBatch("bad quota count")
    return _str(raw[0]), Usage(requests, tokens, in_flight)


def _fingerprint(x: object) -> int:
    """A pool fingerprint: a u64."""
    n = _int(x)
    if n >= 1 << 64:
        raise MalformedBatch("a pool fingerprint is a u64")
    return n


def _sample(pools: list[str], raw: object) -> PeerCalibration:
    if not isinstance(raw, list) or len(raw) != 5:
        raise MalformedBatch("bad calibration sample")
    ratio = raw[4]
    if not isinstance(ratio, float | int) or isinstance(ratio, bool) or not 0.0 <= ratio < math.inf:
        raise MalformedBatch("bad calibration ratio")
    return PeerCalibration(
        _at(pools, raw[0]), _int(raw[1], 1), _tokens(raw[2]), _tokens(raw[3]), float(ratio)
    )
