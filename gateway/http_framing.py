"""Which requests carry a head whose framing the gateway refuses: the `Host` and `Transfer-Encoding`
rules of RFC 9112 that llhttp leaves to the server.

    Host               missing in HTTP/1.1         400 missing_host                   9112 3.2
                       on more than one line       400 duplicate_host                 9112 3.2
                       not host[:port], or empty   400 invalid_host                   9112 3.2
    Transfer-Encoding  in HTTP/1.0                 400 invalid_transfer_encoding      9112 6.1
                       chunked not last, or twice  400 invalid_transfer_encoding      9112 6.3
                       a coding before chunked     501 unsupported_transfer_encoding  9112 6.1

llhttp (strict, as httptools runs it) already refuses some of these itself, as `invalid_http`:
while parsing the field, anything after `chunked` (`chunked, gzip`, `chunked, chunked`, a line
after a `chunked` one) and `Content-Length` with `Transfer-Encoding`, in any version; once the
head is complete, after the check here (which therefore names it), a `Transfer-Encoding` that is
not `chunked` at all. It reads `gzip, chunked` as chunked and hands the body over still gzipped,
serves `Transfer-Encoding: chunked` in HTTP/1.0, and checks nothing about `Host`.

A coding before `chunked` is one the gateway does not implement: it decodes none (the engines take
plain JSON). `identity` is one of them: RFC 7230 removed it (its appendix A.2), the registry only
reserves the name and RFC 9112 7 does not define it, so `identity, chunked` is answered 501 like
`gzip, chunked`. Empty list elements are ignored (RFC 9110 5.6.1), and multiple
`Transfer-Encoding` lines are one list (RFC 9110 5.3). An HTTP/1.0 request may omit `Host`, but
not send two or an invalid one: that MUST is for "any request message". An empty `Host` is invalid
here: an origin server's targets are http URIs, whose host is never empty (RFC 9110 4.2.1, 7.2).

The fields are checked when the head is complete, in one pass over the parsed fields (about 35 ns
a field; noting them as httptools hands them over, in place of uvicorn's `on_header`, measured
slower). A connection remembers the last `Host` it found valid: its next requests, which repeat it,
compare it rather than match the grammar again.

Here too: the rule on a request asking to switch protocols with a body (`has_body`) and the whole
answer the guarded protocol writes when it refuses a request (`refusal_response`).
"""

from __future__ import annotations

import http
import re
from dataclasses import dataclass

import httptools

from gateway.errors import error_body

# Versions before HTTP/1.1, which llhttp also accepts: no Host needed, no Transfer-Encoding allowed.
_BEFORE_1_1 = frozenset(("0.9", "1.0"))

# Host = uri-host [ ":" port ] (RFC 9110 7.2); uri-host is RFC 3986's host (3.2.2): an IP literal
# in brackets (an IPv6 address, loosely, or an IPvFuture), or a reg-name (which an IPv4 address
# also matches) of unreserved characters, sub-delims and percent-encodings; not empty (see the
# module docstring).
_HOST = re.compile(
    rb"(?=[^:])"  # not empty, nor a port alone
    rb"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[0-9A-Za-z._~!$&'()*+,;=:-]+)\]"
    rb"|[0-9A-Za-z._~!$&'()*+,;=-]*(?:%[0-9A-Fa-f]{2}[0-9A-Za-z._~!$&'()*+,;=-]*)*)"  # one way to match
    rb"(?::[0-9]*)?"
)


@dataclass(frozen=True, slots=True)
class FramingFault:
    """Why a head is refused: the answer's status, its error code (also the refusal's reason in
    `kvgate_client_refusals_total`: a fixed set) and its message (never a value the client sent)."""

    status: int
    reason: str
    message: str


MISSING_HOST = FramingFault(400, "missing_host", "an HTTP/1.1 request must have a Host header field")
DUPLICATE_HOST = FramingFault(400, "duplicate_host", "a request must have one Host header field, not several")
INVALID_HOST = FramingFault(400, "invalid_host", "the Host header field is not a valid host[:port]")
TRANSFER_ENCODING_IN_HTTP_1_0 = FramingFault(
    400, "invalid_transfer_encoding", "Transfer-Encoding is not allowed in an HTTP/1.0 request"
)
CHUNKED_NOT_LAST = FramingFault(
    400, "invalid_transfer_encoding", "Transfer-Encoding must end with chunked, applied once"
)
UNSUPPORTED_CODING = FramingFault(
    501,
    "unsupported_transfer_encoding",
    "the only transfer coding the gateway implements is chunked: send the body without any other",
)


def framing_fault(
    http_version: str, host_lines: int, host: bytes, transfer_encoding: bytes | None
) -> FramingFault | None:
    """What is wrong with a request head's framing, given its `Host` field lines (how many, and the
    value of the last), and its `Transfer-Encoding` lines joined by commas (None: none); None if
    nothing is. A body whose length cannot be determined (400: a MUST, RFC 9112 6.3) comes before
    a coding the gateway does not implement (501: a SHOULD, 6.1)."""
    if host_lines != 1:
        if host_lines > 1:
            return DUPLICATE_HOST
        if http_version not in _BEFORE_1_1:
            return MISSING_HOST
    elif _HOST.fullmatch(host) is None:
        return INVALID_HOST
    if transfer_encoding is None:
        return None
    if http_version in _BEFORE_1_1:
        return TRANSFER_ENCODING_IN_HTTP_1_0
    codings = [coding.strip(b" \t").lower() for coding in transfer_encoding.split(b",")]
    codings = [coding for coding in codings if coding]
    if not codings or codings[-1] != b"chunked" or b"chunked" in codings[:-1]:
        return CHUNKED_NOT_LAST
    if len(codings) > 1:
        return UNSUPPORTED_CODING
    return None


class FramingCheck:
    """The framing check of one connection's request heads (see the module docstring)."""

    __slots__ = ("_valid_host",)

    def __init__(self) -> None:
        self._valid_host: bytes | None = None  # the last Host this connection found valid

    def fault(
        self, headers: list[tuple[bytes, bytes]], parser: httptools.HttpRequestParser
    ) -> FramingFault | None:
        """What is wrong with the framing of the head just completed, whose fields (names in lower
        case) are `headers` (`framing_fault`); None if nothing is."""
        host_lines, host, transfer_encoding = 0, b"", None
        for name, value in headers:
            if name == b"host":
                host_lines += 1
                host = value
            elif name == b"transfer-encoding":
                transfer_encoding = value if transfer_encoding is None else transfer_encoding + b"," + value
        if host_lines == 1 and transfer_encoding is None and host == self._valid_host:
            return None
        fault = framing_fault(parser.get_http_version(), host_lines, host, transfer_encoding)
        if fault is None and host_lines == 1:
            self._valid_host = host
        return fault


# llhttp hands over a request that asks to switch protocols (`Connection: upgrade`, as curl's
# `--http2` does on a cleartext URL with `Upgrade: h2c`) at the end of its head, without its body:
# the app read an empty body (a 400 saying the JSON was empty) and the body's bytes were dropped.
# The gateway switches to no protocol; such a request without a body is served as a plain one.
UPGRADE_WITH_BODY = (
    "the gateway does not switch protocols, and a request that asks to (Connection: upgrade) "
    "cannot carry a body: send it without the Upgrade"
)


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request head announces a body (a non-zero `Content-Length`, or any
    `Transfer-Encoding`: llhttp accepts only chunked last)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0")):
            return True
    return False


def refusal_response(status: int, message: str, code: str) -> bytes:
    """A refused request's whole answer (`GuardedHttpToolsProtocol._refuse`): an OpenAI-shaped error
    that closes the connection."""
    body = error_body(message, "invalid_request_error", code)
    phrase = http.HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
