"""The `cors` block: off by default, and what the CORS spec forbids is refused at load."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.config.cors import CorsConfig

BASE: dict[str, Any] = {
    "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}],
    "tenants": [{"name": "t", "api_key_hashes": ["hmac-sha256:" + "0" * 64]}],
}


def test_cors_is_off_unless_origins_are_listed() -> None:
    cors = parse_config(BASE).cors
    assert not cors.enabled
    assert cors.expose_headers[:3] == ["x-request-id", "retry-after", "retry-after-ms"]
    assert "x-ratelimit-remaining-requests" in cors.expose_headers and len(cors.expose_headers) == 15
    assert "anthropic-ratelimit-requests-remaining" in cors.expose_headers
    assert (cors.allow_methods, cors.allow_headers, cors.max_age_s) == (["*"], ["*"], 600)
    assert CorsConfig(allow_origins=["*"]).enabled


def test_methods_and_headers_are_normalized() -> None:
    cors = CorsConfig(
        allow_origins=["https://a.example"], allow_methods=["post"], allow_headers=["Authorization"]
    )
    assert (cors.allow_methods, cors.allow_headers) == (["POST"], ["authorization"])


@pytest.mark.parametrize(
    ("cors", "problem"),
    [
        ({"allow_origins": ["*"], "allow_credentials": True}, "forbidden by the CORS spec"),
        ({"allow_origins": ["https://a.example/"]}, "is not an origin"),
        ({"allow_origins": ["a.example"]}, "is not an origin"),
        ({"allow_origins": ["https://App.example"]}, "is not an origin"),
        ({"allow_origins": ["*", "https://a.example"]}, "must be the only entry"),
        ({"allow_headers": ["bad header"]}, "is not a method or header name"),
        (
            {"allow_origins": ["https://a.example"], "allow_credentials": True, "expose_headers": ["*"]},
            "not a wildcard with allow_credentials",
        ),
    ],
)
def test_what_the_spec_forbids_is_refused_naming_the_field(cors: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match="cors") as refused:
        parse_config({**BASE, "cors": cors})
    assert problem in str(refused.value)
