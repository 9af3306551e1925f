"""The few text fields routing needs from a `multipart/form-data` body (the audio routes).

The body is already bounded (`limits.max_body_bytes`) and is forwarded to the worker byte for
byte with the client's `Content-Type` (its boundary); the gateway only reads the named text
fields (`model`, `stream`) and never looks inside file parts. Parsing is a linear scan over the
parts (RFC 7578: `--boundary` lines, part headers, a blank line, the content), on the event loop,
so the Python work it does is bounded: parts (`MAX_PARTS`), bytes of part headers
(`MAX_PART_HEADER_BYTES`), `Content-Disposition` parameters (`MAX_DISPOSITION_PARAMS`) and lines
that only look like a delimiter (`MAX_LOOKALIKES`). An 8 MiB body of tiny parts, or of one part
header full of `;`, took 2 to 3 s of the loop. A form past a bound is a 400; file contents are
searched by `bytes.find` alone, whatever their size.

A part's name is read as the engines' form parser reads it (Starlette over python-multipart): its
`Content-Disposition` split at the `;` outside quoted strings, the last `name` winning. A part
whose name a parser could read otherwise than the gateway (two `Content-Disposition` headers,
of which Starlette keeps the last; two `name` parameters; an RFC 2231 `name*`, which some releases
decode and RFC 7578 forbids; a wanted field with a `filename*` but no `filename`, a file to some
releases and a field to others) is refused with 400: a name the gateway did not see would reach
the worker unchecked (a second `model`, a `priority`).
"""

from __future__ import annotations

from gateway.errors import bad_request

MAX_FIELD_CHARS = 1024
# The most parts a form may have, and the most bytes all its parts' headers may take together. An
# audio request's form has a file and a dozen short fields, each part's headers some 100 bytes.
MAX_PARTS = 256
MAX_PART_HEADER_BYTES = 64 * 1024
# Lines inside a part that begin like a delimiter but go on (`--boundaryX`): content, yet each costs
# a step in Python to tell apart; a client picks its boundary, real files rarely hold one.
MAX_LOOKALIKES = 64
# Spaces and tabs a delimiter line may carry before its `\r\n` (RFC 2046 transport padding).
MAX_PADDING = 256
# A part's `Content-Disposition` names it and its file (`name`, `filename`, `filename*`).
MAX_DISPOSITION_PARAMS = 16
# RFC 2046's boundary characters (a space, but not as the last character).
_BCHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ")


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a `multipart/form-data` content type; 400 for anything else."""
    if content_type is None:
        raise bad_request("the body must be multipart/form-data (no Content-Type header)")
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise bad_request("the body must be multipart/form-data")
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "boundary":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            if 1 <= len(value) <= 70 and _BCHARS.issuperset(value) and not value.endswith(" "):
                return value.encode()
    raise bad_request("multipart/form-data needs a boundary of 1 to 70 characters (RFC 2046)")


def content_type_header(boundary: bytes) -> bytes:
    """The `Content-Type` line sent to the worker: rebuilt from the checked boundary, so nothing
    else of the client's header reaches the worker."""
    return b'Content-Type: multipart/form-data; boundary="' + boundary + b'"\r\n'


def _disposition(headers: bytes) -> tuple[str | None, bool | None]:
    """The `name` of a part and whether it is a file, as the engines' form parser reads them
    (module docstring): True with a `filename`, None with only a `filename*` (a file to the
    releases of python-multipart that decode it, a field to those that ignore it), else False.
    400 for a part that parser could name otherwise."""
    found: bytes | None = None
    for line in headers.split(b"\r\n"):
        key, _, raw = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        if found is not None:
            raise bad_request("multipart part has more than one Content-Disposition header")
        found = raw
    if found is None:
        return None, False
    value = found.decode("latin-1")
    if value.count(";") > MAX_DISPOSITION_PARAMS:
        raise bad_request(f"multipart Content-Disposition has more than {MAX_DISPOSITION_PARAMS} parameters")
    name = None
    is_file: bool | None = False
    for param in _params(value)[1:]:
        pname, _, pvalue = param.partition("=")
        pname = pname.strip().lower()
        if pname.startswith("name*"):
            raise bad_request("multipart Content-Disposition cannot name a part with 'name*' (RFC 7578)")
        pvalue = pvalue.strip()
        if len(pvalue) >= 2 and pvalue[0] == pvalue[-1] == '"':
            pvalue = pvalue[1:-1].replace("\\\\", "\\").replace('\\"', '"')
        if pname == "name":
            if name is not None:  # python-multipart keeps the last, the standard library the first
                raise bad_request("multipart Content-Disposition names its part twice")
            name = pvalue
        elif pname == "filename":
            is_file = True
        elif pname.startswith("filename*") and is_file is False:
            is_file = None
    return name, is_file


def _params(value: str) -> list[str]:
    """`value` split at each `;` outside a quoted string: one whose part so far holds an even
    number of `"`, less those written `\\"` (the rule of the engines' parser, which is that of the
    standard library's `email.message`). At most `MAX_DISPOSITION_PARAMS` `;`, so the counting
    stays small."""
    parts: list[str] = []
    start = 0
    while True:
        end = value.find(";", start)
        while end >= 0 and (value.count('"', start, end) - value.count('\\"', start, end)) % 2:
            end = value.find(";", end + 1)
        if end < 0:
            parts.append(value[start:])
            return parts
        parts.append(value[start:end])
        start = end + 1


def form_fields(body: bytes, content_type: str | None, names: frozenset[str]) -> dict[str, str]:
    """The text fields of `body` named in `names`; 400 when the body is not a well-formed multipart
    form, a wanted field is not short UTF-8 text or appears twice (engines' form parsers keep the
    last of a repeated field, the gateway would have routed on the first), or the form is past
    the bounds above.

    A delimiter counts only where the workers' parsers see one: at the start of the body or of a
    line, followed by the end of its line or by `--` (the close delimiter). So `--boundaryX`
    inside a file is content, for the gateway as for the worker."""
    delimiters = _Delimiters(boundary_of(content_type), body)
    found: dict[str, str] = {}
    at = delimiters.first()
    if at is None:
        raise bad_request("multipart body has no part with its boundary")
    parts = 0
    header_bytes = 0
    while True:
        line_end, closing = at
        if closing:
            return found
        parts += 1
        if parts > MAX_PARTS:
            raise bad_request(f"multipart body has more than {MAX_PARTS} parts")
        # Part headers follow the delimiter line; a part without headers has the blank line at once.
        head_end = body.find(b"\r\n\r\n", line_end)
        if head_end < 0:
            raise bad_request("multipart part has no end of headers")
        header_bytes += head_end - line_end
        if header_bytes > MAX_PART_HEADER_BYTES:
            raise bad_request(f"multipart part headers take more than {MAX_PART_HEADER_BYTES} bytes")
        content_start = head_end + 4
        content_end = delimiters.next(content_start)
        if content_end < 0:
            raise bad_request("multipart body is not closed by its boundary")
        name, is_file = _disposition(body[line_end + 2 : head_end])
        if name in names and is_file is None:
            raise bad_request(f"form field '{name}' has a 'filename*' without a 'filename'", name)
        if name in names and not is_file:
            if name in found:
                raise bad_request(f"form field '{name}' appears more than once", name)
            try:
                value = body[content_start:content_end].decode()
            except UnicodeDecodeError:
                raise bad_request(f"form field '{name}' is not UTF-8 text", name) from None
            if len(value) > MAX_FIELD_CHARS:
                raise bad_request(f"form field '{name}' is longer than {MAX_FIELD_CHARS} characters", name)
            found[name] = value
        at = delimiters.after(content_end)


class _Delimiters:
    """The delimiters of one body, found with `bytes.find`. A line that starts like a delimiter
    but goes on (`--boundaryX`) is content; past `MAX_LOOKALIKES` of them the form is refused,
    since each costs a step in Python (8 MiB of them took 0.4 s)."""

    __slots__ = ("_body", "_lookalikes", "_marker")

    def __init__(self, boundary: bytes, body: bytes) -> None:
        self._body = body
        self._marker = b"\r\n--" + boundary
        self._lookalikes = 0

    def first(self) -> tuple[int, bool] | None:
        """(where the line after the first delimiter starts, less its `\r\n`; whether it is the
        close delimiter), or None without one."""
        if self._body.startswith(self._marker[2:]):
            ending = self._ending(len(self._marker) - 2)
            if ending is not None:
                return ending
        at = self.next(0)
        return None if at < 0 else self.after(at)

    def next(self, pos: int) -> int:
        """Where the next delimiter (its `\r\n`) is, from `pos`; -1 if none."""
        body, marker = self._body, self._marker
        while True:
            at = body.find(marker, pos)
            if at < 0 or self._ending(at + len(marker)) is not None:
                return at
            self._lookalikes += 1
            if self._lookalikes > MAX_LOOKALIKES:
                raise bad_request(
                    f"multipart body has more than {MAX_LOOKALIKES} lines that begin like its boundary"
                )
            pos = at + len(marker)

    def after(self, at: int) -> tuple[int, bool]:
        """`first`'s answer for the delimiter found at `at` by `next`."""
        ending = self._ending(at + len(self._marker))
        assert ending is not None
        return ending

    def _ending(self, end: int) -> tuple[int, bool] | None:
        """Whether the boundary ending at `end` is a delimiter: `\r\n` next, or the close
        delimiter's `--`; also `\r\n` after spaces and tabs (RFC 2046's transport padding, which
        the engines' python-multipart takes as a delimiter too: read as content here, a padded
        delimiter would start parts the worker sees and the gateway does not). (Where the `\r\n`
        is, whether it closes.) Padding longer than `MAX_PADDING` is refused."""
        body = self._body
        tail = body[end : end + 2]
        if tail == b"\r\n":
            return end, False
        if tail == b"--":
            return end, True
        if tail[:1] not in (b" ", b"\t"):
            return None
        window = body[end : end + MAX_PADDING + 1]
        pad = len(window) - len(window.lstrip(b" \t"))
        if pad > MAX_PADDING:
            raise bad_request(f"multipart boundary followed by more than {MAX_PADDING} spaces or tabs")
        if body[end + pad : end + pad + 2] == b"\r\n":
            return end + pad, False
        return None
