"""The multipart reader of the audio routes (`gateway/multipart.py`): bounded work on hostile
forms, and the fields read where the workers' form parsers read them."""

from __future__ import annotations

import pytest

from gateway.errors import ApiError
from gateway.multipart import MAX_LOOKALIKES, MAX_PARTS, form_fields

CONTENT_TYPE = "multipart/form-data; boundary=b"
WANTED = frozenset({"model", "stream"})


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    file = f'; filename="{filename}"' if filename is not None else ""
    return f'--b\r\nContent-Disposition: form-data; name="{name}"{file}\r\n\r\n'.encode() + value + b"\r\n"


def _refused(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        form_fields(body, CONTENT_TYPE, WANTED)
    assert caught.value.status == 400
    return caught.value


def test_a_plain_form_gives_its_fields() -> None:
    body = (
        _part("file", b"RIFF\x00\x01", "a.wav")
        + _part("model", b"m")
        + _part("stream", b"true")
        + b"--b--\r\n"
    )
    assert form_fields(body, CONTENT_TYPE, WANTED) == {"model": "m", "stream": "true"}


def test_a_form_of_many_tiny_parts_is_refused_at_the_bound() -> None:
    # 8 MiB of empty parts was parsed whole on the event loop (932,000 parts: 2.3 s).
    body = b"--b\r\n\r\nx\r\n" * (MAX_PARTS + 1) + b"--b--\r\n"
    assert "parts" in _refused(body).message
    assert form_fields(b"--b\r\n\r\nx\r\n" * MAX_PARTS + b"--b--\r\n", CONTENT_TYPE, WANTED) == {}


def test_part_headers_are_bounded() -> None:
    # One Content-Disposition of 8 MiB of `;` took 2.9 s to split.
    semicolons = (
        b'--b\r\nContent-Disposition: form-data; name="model"' + b";" * 100 + b"\r\n\r\nm\r\n--b--\r\n"
    )
    assert "parameters" in _refused(semicolons).message
    lines = b"--b\r\n" + b"a: b\r\n" * 20_000 + b"\r\nx\r\n--b--\r\n"
    assert "headers" in _refused(lines).message


def test_a_repeated_field_is_refused() -> None:
    # The gateway routed on the first `model`; the engines' form parsers keep the last.
    body = _part("model", b"a") + _part("model", b"b") + b"--b--\r\n"
    assert _refused(body).param == "model"


def test_a_line_that_only_begins_like_the_boundary_is_content() -> None:
    # Inside the file, `--bX` is no delimiter for a worker's parser: nor for the gateway, which
    # read the fake part after it as the form's `model`.
    inner = b"\r\n--bX\r\n" + b'Content-Disposition: form-data; name="model"\r\n\r\nsmuggled'
    body = _part("file", b"RIFF" + inner, "a.wav") + _part("model", b"real") + b"--b--\r\n"
    assert form_fields(body, CONTENT_TYPE, WANTED) == {"model": "real"}


def test_many_lines_like_the_boundary_are_refused() -> None:
    lookalikes = b"\r\n--bX" * (MAX_LOOKALIKES + 1)
    body = _part("file", lookalikes, "a.wav") + _part("model", b"m") + b"--b--\r\n"
    assert "boundary" in _refused(body).message
    few = _part("file", b"\r\n--bX" * MAX_LOOKALIKES, "a.wav") + _part("model", b"m") + b"--b--\r\n"
    assert form_fields(few, CONTENT_TYPE, WANTED) == {"model": "m"}
