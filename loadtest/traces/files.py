"""Read a trace file whole, plain or compressed.

The compression is recognised by the file's first bytes (gzip or xz magic), not its suffix, so a
renamed file still reads and a plain file is returned as is. Traces are read whole: the largest
shipped one is 3.8 MB uncompressed, and one read decompresses once for both format sniffing and
parsing.
"""

from __future__ import annotations

import gzip
import lzma
import zlib
from pathlib import Path

_GZIP_MAGIC = b"\x1f\x8b"
_XZ_MAGIC = b"\xfd7zXZ\x00"

# What a missing, unreadable or damaged file raises: gzip.BadGzipFile is an OSError, corrupt deflate
# data a zlib.error, a truncated gzip stream EOFError, any bad xz stream LZMAError.
_READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file, line and field."""


def read_trace_bytes(path: str | Path) -> bytes:
    """The uncompressed bytes of a plain, gzip or xz trace file."""
    try:
        raw = Path(path).read_bytes()
        if raw.startswith(_GZIP_MAGIC):
            return gzip.decompress(raw)
        if raw.startswith(_XZ_MAGIC):
            return lzma.decompress(raw, format=lzma.FORMAT_XZ)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such trace file") from None
    except _READ_ERRORS as exc:
        raise TraceFormatError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None
    return raw
