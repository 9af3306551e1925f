"""A form part's name as the gateway reads it (`gateway/multipart.py`) is the name the engines'
form parser reads (Starlette over python-multipart, whose older releases parse the header with
the standard library's `email.message`), or the form is refused: a field the gateway does not see
reaches the worker unchecked (a `priority` engines would schedule by, a second `model`)."""

from __future__ import annotations

from email.message import Message

import pytest

from gateway.bodies import parse_form
from gateway.errors import ApiError
from gateway.multipart import form_fields
from gateway.routes import ROUTES

CONTENT_TYPE = "multipart/form-data; boundary=b"
WANTED = frozenset({"model", "stream", "priority"})


def _form(*dispositions: str) -> bytes:
    """A form of one part per value, each part's content `v`; a value of several lines gives its
    part one Content-Disposition header per line."""
    parts = []
    for disp in dispositions:
        headers = b"".join(f"Content-Disposition: {line}\r\n".encode() for line in disp.split("\n"))
        parts.append(b"--b\r\n" + headers + b"\r\nv\r\n")
    return b"".join(parts) + b"--b--\r\n"


def _stdlib_name(disposition: str) -> str | None:
    """The part's name by the standard library's parser (python-multipart before 0.0.21)."""
    msg = Message()
    msg["content-disposition"] = disposition
    name = msg.get_param("name", header="content-disposition")
    return name[-1] if isinstance(name, tuple) else name


HOSTILE = [
    'form-data; name="priority"; x="; name=other"',  # a `;` inside quotes
    'form-data; name="model"; note="a;b"; name="priority"',  # python-multipart keeps the last name
    "form-data; name*=UTF-8''priority",  # RFC 2231, decoded by some releases
    "form-data; name*0=prio; name*1=rity",  # RFC 2231 continuations
    "form-data; name=\"priority\"; filename*=UTF-8''a.wav",  # a file to some releases only
]


@pytest.mark.parametrize("disposition", HOSTILE)
def test_the_gateway_names_a_part_as_the_engines_do_or_refuses_it(disposition: str) -> None:
    try:
        fields = form_fields(_form(disposition), CONTENT_TYPE, WANTED)
    except ApiError as err:
        assert err.status == 400
        return
    engine_name = _stdlib_name(disposition)
    assert engine_name not in WANTED or engine_name in fields


def test_a_priority_hidden_in_a_quoted_semicolon_is_refused() -> None:
    # `name="priority"; x="; name=other"`: the gateway split at every `;` and read the name
    # `other"`; the worker reads `priority`, and would have scheduled the tenant by it.
    body = _form('form-data; name="model"', 'form-data; name="priority"; x="; name=other"')
    with pytest.raises(ApiError) as caught:
        parse_form(body, CONTENT_TYPE, ROUTES["/v1/audio/transcriptions"])
    assert caught.value.status == 400
    assert caught.value.param == "priority"


def test_a_part_with_two_content_dispositions_is_refused() -> None:
    # Starlette keeps the last of them, the gateway read the first.
    body = _form('form-data; name="model"', 'form-data; name="file"\nform-data; name="model"')
    with pytest.raises(ApiError) as caught:
        form_fields(body, CONTENT_TYPE, WANTED)
    assert caught.value.status == 400
    assert "Content-Disposition" in caught.value.message


def test_a_second_model_as_a_filename_star_part_is_refused() -> None:
    # python-multipart 0.0.21 ignores `filename*`: the part is the form's last `model` field there.
    body = _form('form-data; name="model"', "form-data; name=\"model\"; filename*=UTF-8''a.wav")
    with pytest.raises(ApiError) as caught:
        form_fields(body, CONTENT_TYPE, WANTED)
    assert caught.value.param == "model"


def test_ordinary_forms_still_pass() -> None:
    body = _form(
        'form-data; name="file"; filename="a;b \\"c\\".wav"',
        "form-data; name=\"file2\"; filename*=UTF-8''%C3%A9.wav",
        'form-data; name="model"',
        "form-data; name=stream",
    )
    assert form_fields(body, CONTENT_TYPE, WANTED) == {"model": "v", "stream": "v"}


@pytest.mark.parametrize("padding", [b" ", b"\t", b" \t  "])
def test_a_delimiter_padded_before_its_line_end_starts_a_part_as_on_the_engines(padding: bytes) -> None:
    # RFC 2046 lets a delimiter line carry spaces and tabs before its CRLF, and python-multipart
    # (the engines' parser) starts a part there: read as file content, its fields went unseen.
    body = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
        b"--b" + padding + b'\r\nContent-Disposition: form-data; name="priority"\r\n\r\n-100\r\n'
        b"--b--\r\n"
    )
    fields = form_fields(body, CONTENT_TYPE, WANTED)
    assert fields.get("priority") == "-100" and fields.get("model") == "whisper"


def test_a_delimiter_padded_past_the_limit_is_refused() -> None:
    body = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b' + b" " * 300 + b"\r\n--b--\r\n"
    )
    with pytest.raises(ApiError) as err:
        form_fields(body, CONTENT_TYPE, WANTED)
    assert err.value.status == 400
