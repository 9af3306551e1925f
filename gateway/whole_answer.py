"""A worker's whole answer (not a stream, or an error or whole answer to a streamed request), read:
passed on to the client, rewritten into the route's error shape, or the attempt's failure.

`answer` closes the request's books (`outcome.finish`) for everything it passes on; a failure it
returns leaves the attempt open for the caller, which may try another worker. A 4xx is the
client's problem: its body is rewritten into the route's error shape, the worker's message and
`param` kept, less any quote of the salt the gateway sent (`Admitted.withhold_salts`). The answer's bytes
stay reserved in the answer budget until the client has them (`answer_write.HeldResponse`).
"""

from __future__ import annotations

import orjson

from gateway.admitted import Admitted
from gateway.answer_usage import NO_USAGE, usage_of
from gateway.answer_write import HeldResponse
from gateway.errors import RawResponse
from gateway.failure import Failure, Stage, malformed, says_why, worker_failed, worker_said, worker_status
from gateway.outcome import Attempt, finish
from gateway.retries import advice, forwardable
from gateway.routing import Routing
from gateway.upstream import UpstreamReply
from gateway.upstream_headers import passed_on
from policies.base import Outcome


def is_event_stream(content_type: str) -> bool:
    return _media(content_type) == "text/event-stream"


def answer(
    routing: Routing, a: Admitted, attempt: Attempt, reply: UpstreamReply, retries: int
) -> RawResponse | Failure:
    """A complete answer, whose bytes' reservation (`reply.held`) goes with the body to the
    client's response when the body is passed on as it came (`HeldResponse`), and is released
    here on every other way out: a failure, a rewritten error body, an exception."""
    try:
        response = _respond(routing, a, attempt, reply, retries)
    except BaseException:
        reply.release()
        raise
    if not isinstance(response, HeldResponse):
        reply.release()
    return response


def _respond(
    routing: Routing, a: Admitted, attempt: Attempt, reply: UpstreamReply, retries: int
) -> RawResponse | Failure:
    """`answer`'s response. A 5xx, or a 200 that says it is JSON but whose body is not a JSON
    object (on routes that answer JSON; or an array, on routes whose answer may be one: a batch's
    items, which carry no usage the gateway reads), is the attempt's failure; anything else closes the books
    and is passed through: a 200 byte for byte, an error with its body in the route's error shape,
    the worker's `Retry-After` and the gateway's retry advice (`retries.py`). A 200 of another
    content type is an answer in another format on the routes that have one (vLLM's binary
    embeddings, `encoding_format` "bytes", with their `metadata` header: `binary_answer`; a
    plain-text transcript): it goes to the client with its content type, and the request has no
    usage the gateway can read; on the other JSON routes it is malformed (an HTML error page of
    a proxy in front of the worker, say)."""
    status, body, content_type = reply.status, reply.body, reply.content_type
    if attempt.trace is not None:
        attempt.trace.status = status
    if worker_failed(status, a.api.scale_out):
        said = worker_said(body, a.withhold_salts) if says_why(status) else None
        return worker_status(status, reply.retry_hints, said)
    passed: list[tuple[bytes, bytes]] = []
    if status == 200:
        if not _is_json(content_type):
            if a.api.json_answer and not (a.api.binary_answer and _media(content_type) == _BINARY):
                what = f"content type {content_type[:64]!r}"
                return malformed(f"worker sent a malformed answer ({what})", Stage.ANSWER)
            parsed = None
            passed = passed_on(reply.retry_hints)
        else:
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError:
                parsed = None
            well_formed = isinstance(parsed, dict) or (isinstance(parsed, list) and a.api.answer_may_be_array)
            if not well_formed and a.api.json_answer:
                what = "a JSON object or array" if a.api.answer_may_be_array else "a JSON object"
                return malformed(f"worker sent a malformed answer (its body is not {what})", Stage.ANSWER)
        if not isinstance(parsed, dict):
            usage = NO_USAGE
        else:
            if attempt.trace is not None:
                attempt.trace.note_answer(parsed)
            usage = usage_of(parsed.get("usage"))
            if a.responses is not None:
                a.learn_response(attempt.worker.worker_id, parsed.get("id"))
        finish(routing, a, attempt, status=200, outcome=Outcome.SERVED, usage=usage, retries=retries)
    else:
        # A 4xx is about the request, not the worker's health; the worker computed nothing.
        finish(routing, a, attempt, status=status, outcome=Outcome.REJECTED, retries=retries)
        body = body if isinstance(body, bytes) else bytes(body)
        if status >= 400:
            body = a.api.dialect.worker_error(status, body)
            content_type = "application/json"
        # Any answer but a 200 may quote the request (vLLM's validation errors do).
        body = a.withhold_salts(body)
    headers = [(b"content-type", (content_type or "application/json").encode()), *a.reply_headers()]
    if status >= 400:
        headers += forwardable(reply.retry_hints)
        headers += advice(retries + 1, a.pool.config.retry_attempts, a.retries_taken)
    if reply.held is not None and body is reply.body:
        return HeldResponse(status, body, headers + passed, reply.held)
    return RawResponse(status, body, headers + passed)


_BINARY = "application/octet-stream"


def _media(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _is_json(content_type: str) -> bool:
    """`application/json`, or none (a worker that names no type is read as it always was)."""
    media = _media(content_type)
    return not media or media == "application/json" or media.endswith("+json")
