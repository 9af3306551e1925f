"""The few text fields routing needs from a `multipart/form-data` body (the audio routes).

The body is already bounded (`limits.max_body_bytes`) and is forwarded to the worker byte for
byte with the client's `Content-Type` (its boundary); the gateway only reads the named text
fields (`model`, `stream`) and never looks inside file parts. Parsing is a linear scan over the
parts (RFC 7578: `--boundary` lines, part headers, a blank line, the content).
"""

from __future__ import annotations

from gateway.errors import bad_request

MAX_FIELD_CHARS = 1024
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


def _disposition(headers: bytes) -> tuple[str | None, bool]:
    """The `name` of a part and whether it is a file (has a `filename`)."""
    for line in headers.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        name = None
        is_file = False
        for param in value.decode("latin-1").split(";")[1:]:
            pname, _, pvalue = param.strip().partition("=")
            pvalue = pvalue.strip()
            if len(pvalue) >= 2 and pvalue[0] == pvalue[-1] == '"':
                pvalue = pvalue[1:-1]
            pname = pname.strip().lower()
            if pname == "name":
                name = pvalue
            elif pname in ("filename", "filename*"):
                is_file = True
        return name, is_file
    return None, False


def form_fields(body: bytes, content_type: str | None, names: frozenset[str]) -> dict[str, str]:
    """The text fields of `body` named in `names` (first occurrence wins); 400 when the body is
    not a well-formed multipart form or a wanted field is not short UTF-8 text."""
    boundary = boundary_of(content_type)
    delimiter = b"--" + boundary
    found: dict[str, str] = {}
    pos = body.find(delimiter)
    if pos < 0:
        raise bad_request("multipart body has no part with its boundary")
    while True:
        start = pos + len(delimiter)
        if body.startswith(b"--", start):  # the close delimiter
            return found
        line_end = body.find(b"\r\n", start)
        if line_end < 0:
            raise bad_request("multipart body ends inside a part")
        # Part headers follow the delimiter line; a part without headers has the blank line at once.
        head_end = body.find(b"\r\n\r\n", line_end)
        if head_end < 0:
            raise bad_request("multipart part has no end of headers")
        content_start = head_end + 4
        nxt = body.find(b"\r\n" + delimiter, content_start)
        if nxt < 0:
            raise bad_request("multipart body is not closed by its boundary")
        name, is_file = _disposition(body[line_end + 2 : head_end])
        if name in names and not is_file and name not in found:
            raw = body[content_start:nxt]
            try:
                value = raw.decode()
            except UnicodeDecodeError:
                raise bad_request(f"form field '{name}' is not UTF-8 text", name) from None
            if len(value) > MAX_FIELD_CHARS:
                raise bad_request(f"form field '{name}' is longer than {MAX_FIELD_CHARS} characters", name)
            found[name] = value
        pos = nxt + 2
