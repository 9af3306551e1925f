"""The `cors` block: which browser origins may call the gateway (`gateway/cors.py`)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Frozen

# An origin as a browser serializes it: scheme, host and optional port, no path, no trailing slash.
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$")
# An HTTP token (RFC 9110): what a method or a header field name is made of.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _only_star(values: list[str], what: str) -> None:
    if "*" in values and len(values) > 1:
        raise ValueError(f"{what}: '*' must be the only entry")


def _tokens(values: list[str], what: str) -> None:
    for value in values:
        if value != "*" and not _TOKEN.match(value):
            raise ValueError(f"{what}: {value!r} is not a method or header name")


# The answer headers a page may read unless `expose_headers` says otherwise: the request id, the
# retry hints and the tenant's rate limits, as OpenAI writes them (`rate_buckets.openai_rate_headers`)
# and, on the Messages routes, as Anthropic does (`anthropic.rate_headers`).
EXPOSED_BY_DEFAULT = (
    "x-request-id",
    "retry-after",
    "retry-after-ms",
    *(
        f"x-ratelimit-{what}-{unit}"
        for unit in ("requests", "tokens")
        for what in ("limit", "remaining", "reset")
    ),
    *(
        f"anthropic-ratelimit-{unit}-{what}"
        for unit in ("requests", "tokens")
        for what in ("limit", "remaining", "reset")
    ),
)


class CorsConfig(Frozen):
    """Cross-origin requests from browsers, off unless `allow_origins` lists some. When on, a
    preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) of a served route is
    answered by the gateway itself, and every answer to an allowed origin carries the
    `Access-Control-*` headers. `*` in `allow_methods` or `allow_headers` allows any (the
    requested headers are named back, as the spec's `*` never covers `Authorization`). The CORS
    spec forbids `*` as the allowed origin of a request with credentials, so `allow_credentials`
    needs the origins listed: `allow_origins: ["*"]` with it is refused here rather than
    silently turned into "every origin, with credentials"."""

    allow_origins: list[str] = Field(default=[], max_length=256)
    allow_methods: list[str] = Field(default=["*"], min_length=1, max_length=64)
    allow_headers: list[str] = Field(default=["*"], min_length=1, max_length=256)
    expose_headers: list[str] = Field(default=list(EXPOSED_BY_DEFAULT), max_length=256)
    allow_credentials: bool = False
    # Starlette's CORSMiddleware default, which vLLM's server inherits.
    max_age_s: int = Field(default=600, ge=0, le=86_400)

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        _only_star(origins, "allow_origins")
        for origin in origins:
            if origin != "*" and (not _ORIGIN.match(origin) or origin != origin.lower()):
                raise ValueError(
                    f"allow_origins: {origin!r} is not an origin (scheme://host[:port], lower case, "
                    "no path or trailing slash)"
                )
        return origins

    @field_validator("allow_methods")
    @classmethod
    def _methods(cls, methods: list[str]) -> list[str]:
        _only_star(methods, "allow_methods")
        _tokens(methods, "allow_methods")
        return [m.upper() for m in methods]

    @field_validator("allow_headers", "expose_headers")
    @classmethod
    def _headers(cls, names: list[str]) -> list[str]:
        _only_star(names, "header names")
        _tokens(names, "header names")
        return [n.lower() for n in names]

    @model_validator(mode="after")
    def _credentials(self) -> CorsConfig:
        if self.allow_credentials and self.allow_origins == ["*"]:
            raise ValueError(
                "allow_credentials with allow_origins ['*'] is forbidden by the CORS spec; list the origins"
            )
        if self.allow_credentials and self.expose_headers == ["*"]:
            raise ValueError("expose_headers '*' is not a wildcard with allow_credentials; list the headers")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)
