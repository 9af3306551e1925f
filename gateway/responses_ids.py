"""Stored-response ids that name their owner, checkable by any gateway process from the id alone.

vLLM names the response a `POST /v1/responses` creates after the body's `request_id`. The gateway
always sets that field, so every id of a response stored through it is

    <stem>_<tag>    tag = base32(HMAC-SHA256(k, namespace ‖ 0x00 ‖ stem)[:15]), 24 characters

where `stem` is `resp_` and 32 random hex digits (vLLM's own form), or, when the client sent its
own `request_id`, that value, `_` and 16 random hex digits; then, for a response created for a
served model, `_` and its scope, `s` and base32(HMAC-SHA256(k, 0x00 ‖ model)[:5]), 9 characters
(a namespace is never empty, so no tag is computed over the same bytes). `namespace` is the
creating tenant's (`policies.identity.tenant_namespace`, which never contains 0x00); and `k` is
the deployment's key-hash secret's sub-secret `response_ids` (`derive_secret`), the same in every
process and replica that shares the secret.

The scope says which pool created the response: the model picked it. A process that does not know
the id searches that pool only (`responses_search.pools_to_search`), not every pool, where an
unrelated worker that is down would leave it unable to say "not found". It is opaque (no model
name in clear) and covered by the tag; an id minted before ids had one (its stem ends in hex
digits, a scope never does), or naming no model served now, is searched for in every pool.

Every id is new, whatever the client sends: a `request_id` the client uses again (a retry, a
fixed name per conversation) names a new response each time, never one stored before. Otherwise
two requests with one `request_id` routed to two workers would leave both holding one id, and a
process that does not know the id would find whichever it asks first (`find_holder`), another
response than the client's last. The random part is 64 bits: the odds that two of a tenant's
responses share an id reach one half only after about four billion requests with one `request_id`.

Whoever names an id (a follow-up's `previous_response_id`, `GET` or `cancel`) is its owner only
when the tag verifies for its own namespace: 120 bits that cannot be computed without the secret,
compared in constant time. Nothing else is remembered or consulted, so the answer is the same in
every process and after a restart. Two tenants' ids never collide, whatever stems they choose: the
tag's fixed length splits an id one way only, and equal stems under different namespaces get
different tags.

Ids are at most `MAX_RESPONSE_ID_CHARS` characters from `[A-Za-z0-9_.:-]`: a client's
`request_id` at most `MAX_REQUEST_ID_CHARS`, plus the random part, the scope, the separators and
the tag.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import TypeGuard

from policies.identity import derive_secret, tenant_namespace

TAG_CHARS = 24
_TAG_BYTES = 15  # 120 bits: 24 base32 characters, no padding
_SEPARATOR = "_"
# What makes a stem on a client's `request_id` unique: 64 bits, 16 hex digits.
_UNIQUE_BYTES = 8
UNIQUE_CHARS = 2 * _UNIQUE_BYTES
# A client's own `request_id` (the stem's start); vLLM's ids are 37 characters, and this leaves
# room for a client's scheme (UUIDs, prefixes) while keeping 100,000 remembered ids within tens of
# megabytes.
MAX_REQUEST_ID_CHARS = 256
# An id's scope: the mark (never a hex digit, which ends every stem minted without one) and 40 bits
# of the model's keyed hash, 8 base32 characters; two models sharing one only widen the search.
_SCOPE_MARK = "s"
_SCOPE_BYTES = 5
SCOPE_CHARS = 1 + 8
MAX_RESPONSE_ID_CHARS = MAX_REQUEST_ID_CHARS + 1 + UNIQUE_CHARS + 1 + SCOPE_CHARS + 1 + TAG_CHARS
_ID_CHARS = re.compile(r"[A-Za-z0-9_.:-]+")


def valid_response_id(value: object, max_chars: int = MAX_RESPONSE_ID_CHARS) -> TypeGuard[str]:
    """Whether `value` is a non-empty string of at most `max_chars` characters of the id alphabet."""
    return isinstance(value, str) and 0 < len(value) <= max_chars and _ID_CHARS.fullmatch(value) is not None


class ResponseIds:
    """Mints the ids of a deployment's stored responses and tells their owners (module doc)."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        self._key = derive_secret(secret, "response_ids")

    def mint(self, tenant: str, request_id: str | None = None, model: str | None = None) -> str:
        """The id of a new response of tenant `tenant`, never minted before: on the client's own
        `request_id` when it sent one (a valid id of at most `MAX_REQUEST_ID_CHARS` characters),
        followed by a random part, else vLLM's random form; then the scope of `model` (the served
        model it is created for), if given; then the tag."""
        if request_id is None:
            stem = "resp_" + secrets.token_hex(16)
        else:
            stem = request_id + _SEPARATOR + secrets.token_hex(_UNIQUE_BYTES)
        if model is not None:
            stem += _SEPARATOR + self.scope(model)
        return stem + _SEPARATOR + self._tag(tenant_namespace(tenant), stem)

    def scope(self, model: str) -> str:
        """The scope an id minted for served model `model` carries (module doc)."""
        digest = hmac.new(self._key, b"\x00" + model.encode(), hashlib.sha256).digest()
        return _SCOPE_MARK + base64.b32encode(digest[:_SCOPE_BYTES]).decode().lower()

    @staticmethod
    def scope_of(response_id: str) -> str | None:
        """The scope of an id (one `owned_by` accepted), None when it was minted without one."""
        last = response_id[: -TAG_CHARS - 1].rpartition(_SEPARATOR)[2]
        return last if len(last) == SCOPE_CHARS and last.startswith(_SCOPE_MARK) else None

    def owned_by(self, response_id: object, tenant: str) -> bool:
        """Whether `response_id` was minted for tenant `tenant` under this deployment's secret.
        False for anything else alike: another tenant's id, a made-up one, one from before the
        gateway minted ids, a value that is not an id at all."""
        if not valid_response_id(response_id):
            return False
        cut = len(response_id) - TAG_CHARS
        if cut < 2 or response_id[cut - 1] != _SEPARATOR:
            return False
        stem = response_id[: cut - 1]
        expected = self._tag(tenant_namespace(tenant), stem)
        return hmac.compare_digest(response_id[cut:].encode(), expected.encode())

    def _tag(self, namespace: str, stem: str) -> str:
        digest = hmac.new(self._key, namespace.encode() + b"\x00" + stem.encode(), hashlib.sha256).digest()
        return base64.b32encode(digest[:_TAG_BYTES]).decode().lower()
