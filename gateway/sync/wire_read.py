"""Reading one msgpack map of lists and rows by its containers' headers, each count checked
before anything in the container is built: one msgpack byte can be an empty array, a 72-byte
Python list, so a sync batch decoded whole before its shape was checked cost about 70 times its
size (600 MB and seconds of the event loop for 8 MiB).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import msgpack

__all__ = ["MalformedBatch", "read_map"]


class MalformedBatch(ValueError):
    """Bytes that are not a sync batch of this version."""


def read_map(
    data: bytes | memoryview,
    *,
    lists: Mapping[str, int],
    rows: Mapping[str, int],
    scalars: frozenset[str],
    max_fields: int,
    max_row: int,
    max_str: int,
) -> dict[str, Any]:
    """The top-level map of `data`: each field named in `rows` a list of at most that many rows
    (each a list of at most `max_row` scalars), each in `lists` a list of at most that many
    scalars, each in `scalars` one scalar; at most `max_fields` fields, strings of at most
    `max_str` bytes. The unpacker refuses any array or map with entries, so each `unpack` builds
    one object (at most an empty list or map, which no check of a scalar takes for one). A field
    named in none is skipped without being built (later releases may add fields). Anything else
    is `MalformedBatch`."""
    u = msgpack.Unpacker(None, raw=False, max_str_len=max_str, max_array_len=0, max_map_len=0, max_ext_len=0)
    u.feed(data)
    n = u.read_map_header()
    if n > max_fields:
        raise MalformedBatch("not a sync batch")
    doc: dict[str, Any] = {}
    for _ in range(n):
        name = u.unpack()
        if not isinstance(name, str) or name in doc:
            raise MalformedBatch("bad field name")
        if name in rows:
            doc[name] = _rows(u, rows[name], max_row)
        elif name in lists:
            doc[name] = _scalars(u, lists[name])
        elif name in scalars:
            doc[name] = u.unpack()
        else:
            u.skip()
    if u.tell() != len(data):
        raise MalformedBatch("bytes after the batch")
    return doc


def _count(u: msgpack.Unpacker, limit: int) -> int:
    n = u.read_array_header()
    if n > limit:
        raise MalformedBatch("more entries than any gateway publishes in one batch")
    return cast(int, n)


def _scalars(u: msgpack.Unpacker, limit: int) -> list[object]:
    unpack = u.unpack
    return [unpack() for _ in range(_count(u, limit))]


def _rows(u: msgpack.Unpacker, limit: int, max_row: int) -> list[list[object]]:
    unpack, header = u.unpack, u.read_array_header
    out = []
    for _ in range(_count(u, limit)):
        n = header()
        if n > max_row:
            raise MalformedBatch("bad row")
        out.append([unpack() for _ in range(n)])
    return out
