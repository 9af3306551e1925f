"""A form's `stream` (`/v1/audio/transcriptions`, `/translations`) is read as vLLM's form model
reads it, a lax pydantic `bool`: `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`, `t`/`f`,
`y`/`n` in any case; anything else is the same 400 as before."""

from __future__ import annotations

import pytest

from gateway.bodies import parse_form
from gateway.errors import ApiError
from gateway.routes import ROUTES

AUDIO = ROUTES["/v1/audio/transcriptions"]
TRUE = ["true", "True", "TRUE", "1", "yes", "YES", "on", "On", "t", "T", "y", "Y"]
FALSE = ["false", "False", "0", "no", "off", "OFF", "f", "F", "n", "N"]


def _form(stream: str) -> tuple[bytes, str]:
    body = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--b\r\nContent-Disposition: form-data; name="stream"\r\n\r\n' + stream.encode() + b"\r\n--b--\r\n"
    )
    return body, "multipart/form-data; boundary=b"


@pytest.mark.parametrize(("value", "expected"), [(v, True) for v in TRUE] + [(v, False) for v in FALSE])
def test_a_form_stream_reads_as_a_lax_boolean(value: str, expected: bool) -> None:
    assert parse_form(*_form(value), AUDIO)["stream"] is expected


@pytest.mark.parametrize("value", ["maybe", "2", " true", "", "1.0", "tru"])
def test_a_form_stream_lax_mode_refuses_is_a_400(value: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_form(*_form(value), AUDIO)
    assert info.value.status == 400 and info.value.param == "stream"
