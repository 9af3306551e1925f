"""The `sync` block of the gateway config: replica sync through a NATS or Redis/Valkey broker
(docs/sync.md)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Frozen, PositiveFloat, PositiveInt

_Name = Field(default=None, min_length=1)


Broker = Literal["nats", "redis"]
_SCHEMES: dict[str, Broker] = {"nats": "nats", "tls": "nats", "redis": "redis", "rediss": "redis"}


class SyncAuthConfig(Frozen):
    """How this gateway proves itself to the broker (docs/sync.md, "Broker authentication"): a
    token, or a user and password (to Redis/Valkey: `AUTH password`, or `AUTH user password` for
    an ACL user). Secrets come from a file or an environment variable, never
    from this YAML, and are read once at start. None set: the broker is asked for nothing."""

    token_file: str | None = _Name
    token_env: str | None = _Name
    user: str | None = _Name
    password_file: str | None = _Name
    password_env: str | None = _Name

    @model_validator(mode="after")
    def _one_way(self) -> SyncAuthConfig:
        if self.token_file is not None and self.token_env is not None:
            raise ValueError("set token_file or token_env, not both")
        if self.password_file is not None and self.password_env is not None:
            raise ValueError("set password_file or password_env, not both")
        has_password = self.password_file is not None or self.password_env is not None
        if (self.user is None) != (not has_password):
            raise ValueError("user and a password (password_file or password_env) go together")
        if self.user is not None and (self.token_file is not None or self.token_env is not None):
            raise ValueError("set a token or a user and password, not both")
        return self


class SyncTlsConfig(Frozen):
    """TLS to the broker beyond a `tls://` or `rediss://` URL's defaults: the CA that signed the broker's
    certificate (else the system's), and a client certificate and key for brokers that verify
    clients."""

    ca_file: str | None = _Name
    cert_file: str | None = _Name
    key_file: str | None = _Name

    @model_validator(mode="after")
    def _pair(self) -> SyncTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class SyncConfig(Frozen):
    """Replica sync (docs/sync.md): gateways sharing one worker fleet publish their routing decisions
    and in-flight load through a broker and apply each other's: NATS (`nats://`, `tls://`, several
    URLs of one cluster comma-separated) or Redis/Valkey pub/sub (`redis://`, `rediss://` for TLS,
    exactly one URL). Off unless `url` is set.

    The broker is never on a request's path: items wait in a queue of `queue_max_items` (the
    oldest is dropped and counted when it is full) and go out in batches of up to
    `batch_max_items`, `batch_interval_s` after the first of them. Every `load_refresh_s` the
    whole in-flight load goes out even if unchanged; a peer silent for `peer_timeout_s` is
    forgotten with its load. With `share_calibration` each completion's calibration sample is
    published too and peers fold it into their cost model, so that every gateway calibrates from
    all of the fleet's completions; off (the default: gateways that calibrate alike also choose
    alike for requests that arrive together, see docs/sync.md), a gateway neither publishes nor
    applies them and calibrates from its own. `auth` and `tls` say how it connects to a broker
    that authenticates its clients."""

    url: str | None = Field(default=None, pattern=r"^(nats|tls|redis|rediss)://")
    subject_prefix: str = Field(default="kvgate.sync", pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
    # Peers refuse a batch of more than twice `sync.codec.PUBLISH_BATCH_ITEMS` items, and a
    # publisher sends at most that many: a larger setting would be capped without a word.
    batch_max_items: PositiveInt = Field(default=256, le=8192)
    batch_interval_s: PositiveFloat = 0.005
    queue_max_items: PositiveInt = 16_384
    load_refresh_s: PositiveFloat = 1.0
    peer_timeout_s: PositiveFloat = 5.0
    connect_timeout_s: PositiveFloat = 2.0
    share_calibration: bool = False
    auth: SyncAuthConfig = SyncAuthConfig()
    tls: SyncTlsConfig | None = None

    @field_validator("url")
    @classmethod
    def _no_userinfo(cls, value: str | None) -> str | None:
        # A URL is printed and passed on command lines; a secret in it would go with it.
        if value is not None and any("@" in urlsplit(u.strip()).netloc for u in value.split(",")):
            raise ValueError("put the broker's credentials in sync.auth, not in the URL")
        if value is not None:
            _check_urls([u.strip() for u in value.split(",")])
        return value

    @property
    def broker(self) -> Broker | None:
        """Which kind of broker `url` names (None: sync is off)."""
        return None if self.url is None else _SCHEMES[urlsplit(self.url.strip()).scheme]

    @property
    def urls(self) -> list[str]:
        """`url`'s URLs, one per comma-separated entry."""
        return [] if self.url is None else [u.strip() for u in self.url.split(",")]

    @model_validator(mode="after")
    def _timeouts(self) -> SyncConfig:
        if self.peer_timeout_s <= self.load_refresh_s:
            raise ValueError("peer_timeout_s must be longer than load_refresh_s")
        return self


def _check_urls(urls: list[str]) -> None:
    """NATS URLs may be several (servers of one cluster, any of which routes to all); a Redis or
    Valkey URL is one server, or one endpoint in front of a primary: separate Redis servers do not
    forward each other's pub/sub, so gateways on different ones would silently not share."""
    kinds = {_SCHEMES.get(urlsplit(u).scheme) for u in urls}
    if len(kinds) > 1:
        raise ValueError("one kind of broker: nats:// and tls:// URLs, or one redis:// or rediss:// URL")
    if kinds == {"redis"}:
        if len(urls) > 1:
            raise ValueError(
                "one redis:// or rediss:// URL: separate Redis/Valkey servers do not share pub/sub "
                "messages (name one server, or one endpoint in front of the primary)"
            )
        parts = urlsplit(urls[0])
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError:
            raise ValueError(f"not a valid port in {urls[0]!r}") from None
        if not parts.hostname:
            raise ValueError(f"no host in {urls[0]!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(
                "a redis:// URL is host and port only (pub/sub channels are not per database; "
                "credentials go in sync.auth, TLS files in sync.tls)"
            )
