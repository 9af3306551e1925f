"""The `sync` block of the gateway config: replica sync through a NATS or Redis/Valkey broker
(docs/sync.md)."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Frozen, PositiveFloat, PositiveInt

_Name = Field(default=None, min_length=1)


Broker = Literal["nats", "redis"]
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_SCHEMES: dict[str, Broker] = {
    "nats": "nats",
    "tls": "nats",
    "redis": "redis",
    "rediss": "redis",
    **dict.fromkeys(_SENTINEL_SCHEMES + _CLUSTER_SCHEMES, "redis"),
}
# A deployment runs 3 or 5 sentinels; each is asked in turn, so their number bounds a resolution.
# The seeds of a cluster are tried in turn too.
MAX_SENTINELS = 16
MAX_SEEDS = 16
SENTINEL_PORT = 26379
_MASTER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}$")


class HostPort(NamedTuple):
    """One TCP endpoint: a sentinel, or the primary a sentinel names."""

    host: str
    port: int


class SentinelTarget(NamedTuple):
    """What a `redis+sentinel://h1:26379,h2:26379/NAME` URL names: the sentinels to ask, in the
    URL's order, for the address of the primary they monitor as `master`; `tls` for
    `rediss+sentinel://` (sentinels and primary alike)."""

    sentinels: tuple[HostPort, ...]
    master: str
    tls: bool


class ClusterTarget(NamedTuple):
    """What a `redis+cluster://h1:6379,h2:6379` URL names: nodes of one Redis Cluster, any of which
    forwards a classic PUBLISH to all the others, tried in the URL's order; `tls` for
    `rediss+cluster://`."""

    seeds: tuple[HostPort, ...]
    tls: bool


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
    exactly one URL; or `redis+sentinel://h1:26379,h2:26379/NAME`, `rediss+sentinel://` for TLS:
    the primary the sentinels monitor as NAME, followed across failovers; `sentinel_auth` is the
    sentinels' own password; or `redis+cluster://h1:6379,h2:6379`, nodes of one Redis Cluster).
    Off unless `url` is set.

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

    url: str | None = Field(default=None, pattern=r"^(nats|tls|rediss?(\+sentinel|\+cluster)?)://")
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
    # The sentinels' own password (their `requirepass`), for a redis+sentinel:// URL: redis-py's
    # `sentinel_kwargs` and go-redis's SentinelPassword, apart from the primary's (`auth`).
    sentinel_auth: SyncAuthConfig | None = None
    tls: SyncTlsConfig | None = None

    @field_validator("url")
    @classmethod
    def _no_userinfo(cls, value: str | None) -> str | None:
        # A URL is printed and passed on command lines; a secret in it would go with it.
        if value is not None and any("@" in urlsplit(u.strip()).netloc for u in value.split(",")):
            raise ValueError("put the broker's credentials in sync.auth, not in the URL")
        scheme = None if value is None else urlsplit(value.strip()).scheme
        if value is not None and scheme in _SENTINEL_SCHEMES:
            parse_sentinel_url(value)
        elif value is not None and scheme in _CLUSTER_SCHEMES:
            parse_cluster_url(value)
        elif value is not None:
            _check_urls([u.strip() for u in value.split(",")])
        return value

    @property
    def broker(self) -> Broker | None:
        """Which kind of broker `url` names (None: sync is off)."""
        return None if self.url is None else _SCHEMES[urlsplit(self.url.strip()).scheme]

    @property
    def urls(self) -> list[str]:
        """`url`'s URLs, one per comma-separated entry (a redis+sentinel:// or redis+cluster://
        URL is one)."""
        if self.url is None:
            return []
        if urlsplit(self.url.strip()).scheme in _SENTINEL_SCHEMES + _CLUSTER_SCHEMES:
            return [self.url.strip()]
        return [u.strip() for u in self.url.split(",")]

    @property
    def sentinel(self) -> SentinelTarget | None:
        """The sentinels and master a redis+sentinel:// `url` names (None for any other URL)."""
        if self.url is None or urlsplit(self.url.strip()).scheme not in _SENTINEL_SCHEMES:
            return None
        return parse_sentinel_url(self.url)

    @property
    def cluster(self) -> ClusterTarget | None:
        """The nodes a redis+cluster:// `url` names (None for any other URL)."""
        if self.url is None or urlsplit(self.url.strip()).scheme not in _CLUSTER_SCHEMES:
            return None
        return parse_cluster_url(self.url)

    @model_validator(mode="after")
    def _timeouts(self) -> SyncConfig:
        if self.peer_timeout_s <= self.load_refresh_s:
            raise ValueError("peer_timeout_s must be longer than load_refresh_s")
        if self.sentinel_auth is not None and self.sentinel is None:
            raise ValueError(
                "sentinel_auth is the sentinels' own password: it goes with a redis+sentinel:// url "
                "(the broker's own credentials go in sync.auth)"
            )
        return self


def _check_urls(urls: list[str]) -> None:
    """NATS URLs may be several (servers of one cluster, any of which routes to all); a Redis or
    Valkey URL is one server, or one endpoint in front of a primary: separate Redis servers do not
    forward each other's pub/sub, so gateways on different ones would silently not share."""
    for u in urls:
        if len(urls) > 1 and urlsplit(u).scheme in _SENTINEL_SCHEMES + _CLUSTER_SCHEMES:
            raise ValueError(_alone(urlsplit(u).scheme))
    kinds = {_SCHEMES.get(urlsplit(u).scheme) for u in urls}
    if len(kinds) > 1:
        raise ValueError("one kind of broker: nats:// and tls:// URLs, or one redis:// or rediss:// URL")
    if kinds == {"redis"}:
        if len(urls) > 1:
            raise ValueError(
                "one redis:// or rediss:// URL: separate Redis/Valkey servers do not share pub/sub "
                "messages (name one server, or one endpoint in front of the primary; the nodes of "
                "one Redis Cluster: redis+cluster://h1:6379,h2:6379)"
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


def _alone(scheme: str) -> str:
    example = "h1:26379,h2:26379/MASTER" if scheme in _SENTINEL_SCHEMES else "h1:6379,h2:6379"
    what = "sentinel" if scheme in _SENTINEL_SCHEMES else "node"
    return (
        f"a {scheme}:// URL stands alone: name every {what} in it, comma-separated "
        f"({scheme}://{example}), and no other URL"
    )


def parse_cluster_url(url: str) -> ClusterTarget:
    """`redis+cluster://h1:6379,h2:6379` (`rediss+cluster://` for TLS) as its nodes (6379 when a
    port is left out); a ValueError says what is wrong."""
    scheme, authority, _, path = _split(url)
    if path:
        raise ValueError(
            f"a {scheme}:// URL is its nodes only, host:port comma-separated (pub/sub channels are "
            "not per database; credentials go in sync.auth, TLS files in sync.tls)"
        )
    seeds = _hosts(authority.split(","), 6379, "node", MAX_SEEDS)
    return ClusterTarget(seeds, tls=scheme == "rediss+cluster")


def _split(url: str) -> tuple[str, str, str, str]:
    """A `redis+cluster://` or `redis+sentinel://` URL as (scheme, hosts, "/" or "", the rest),
    refused when another URL follows it or it carries credentials."""
    scheme, _, rest = url.strip().partition("://")
    authority, slash, path = rest.partition("/")
    if "://" in rest:
        raise ValueError(_alone(scheme))
    if "@" in authority:
        raise ValueError("put the broker's credentials in sync.auth, not in the URL")
    return scheme, authority, slash, path


def _hosts(entries: list[str], default_port: int, what: str, most: int) -> tuple[HostPort, ...]:
    """`host:port` entries as endpoints, each once, at most `most` of them."""
    if len(entries) > most:
        raise ValueError(f"at most {most} {what}s, not {len(entries)}")
    hosts: list[HostPort] = []
    for entry in entries:
        parts = urlsplit(f"//{entry.strip()}")
        try:
            port = default_port if parts.port is None else parts.port
        except ValueError:
            port = 0
        if not port:
            raise ValueError(f"not a valid port in {entry!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"a {what} is host:port only, not {entry.strip()!r}")
        if not parts.hostname:
            raise ValueError(f"no host in the {what} {entry!r}")
        host = HostPort(parts.hostname, port)
        if host in hosts:
            raise ValueError(f"the {what} {entry.strip()!r} is named twice")
        hosts.append(host)
    return tuple(hosts)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`redis+sentinel://h1:26379,h2:26379/NAME` (`rediss+sentinel://` for TLS) as its sentinels
    (26379 when a port is left out) and master name; a ValueError says what is wrong. The form is
    Harbor's and the `redis-sentinel-url` package's; credentials, a database, a query are refused
    as for a redis:// URL."""
    scheme, authority, slash, master = _split(url)
    if not slash or not master:
        raise ValueError(
            f"name the master the sentinels monitor after them: {scheme}://h1:26379,h2:26379/MASTER"
        )
    if not _MASTER_NAME.match(master):
        raise ValueError(
            f"a {scheme}:// URL is its sentinels and one master name only, not {master!r} "
            "(pub/sub channels are not per database; credentials go in sync.auth and "
            "sync.sentinel_auth, TLS files in sync.tls)"
        )
    sentinels = _hosts(authority.split(","), SENTINEL_PORT, "sentinel", MAX_SENTINELS)
    return SentinelTarget(sentinels, master, tls=scheme == "rediss+sentinel")
