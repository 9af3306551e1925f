"""What the sync link presents to the broker: `sync.auth`'s secret and `sync.tls`'s context, as
nats-py's connect options (the Redis link maps the same options to AUTH and rediss, `redis_link`),
and `sync.sentinel_auth`'s secret to the sentinels of a `redis+sentinel://` URL. Read once at
start (`serve.read_start_secrets`, before any process starts); a missing or empty secret, or a
certificate that does not load, is a ConfigError naming the field, never the secret. So is a
`redis://` URL without the Redis client installed (the `[redis]` extra)."""

from __future__ import annotations

import importlib.util
import ssl
from collections.abc import Mapping
from typing import NamedTuple

from gateway.config.base import ConfigError, read_file_or_env
from gateway.config.sync import SyncConfig, SyncTlsConfig

ConnectOptions = dict[str, "str | ssl.SSLContext"]


def connect_options(config: SyncConfig, environ: Mapping[str, str]) -> ConnectOptions:
    """nats.connect's `token`, `user`/`password` and `tls` for this config (empty when it asks
    for none)."""
    if config.broker == "redis" and importlib.util.find_spec("redis") is None:
        raise ConfigError(
            "sync.url: a redis:// or rediss:// broker needs the Redis client: pip install 'kvgate[redis]'"
        )
    auth = config.auth
    options: ConnectOptions = {}
    token = read_file_or_env("sync.auth.token", auth.token_file, auth.token_env, environ)
    if token is not None:
        options["token"] = token
    password = read_file_or_env("sync.auth.password", auth.password_file, auth.password_env, environ)
    if auth.user is not None and password is not None:
        options["user"] = auth.user
        options["password"] = password
    if config.tls is not None:
        options["tls"] = tls_context(config.tls)
    return options


class SentinelCredentials(NamedTuple):
    """What the sentinels are asked with: `user` (None: the default one) and `password` (None:
    nothing)."""

    user: str | None
    password: str | None


def sentinel_credentials(config: SyncConfig, environ: Mapping[str, str]) -> SentinelCredentials:
    """The user and password `sync.sentinel_auth` names, read now (a ConfigError names a missing
    one, as `connect_options` does `sync.auth`'s)."""
    auth = config.sentinel_auth
    if auth is None:
        return SentinelCredentials(None, None)
    field = "sync.sentinel_auth"
    token = read_file_or_env(f"{field}.token", auth.token_file, auth.token_env, environ)
    if token is not None:
        return SentinelCredentials(None, token)
    password = read_file_or_env(f"{field}.password", auth.password_file, auth.password_env, environ)
    return SentinelCredentials(auth.user, password)


def tls_context(tls: SyncTlsConfig) -> ssl.SSLContext:
    """A client context that verifies the broker against `ca_file` (else the system's CAs) and
    presents `cert_file`/`key_file` when set."""
    try:
        context = ssl.create_default_context(cafile=tls.ca_file)
    except OSError as exc:
        raise ConfigError(f"sync.tls.ca_file: cannot load {tls.ca_file!r}: {_reason(exc)}") from None
    if tls.cert_file is not None and tls.key_file is not None:
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file)
        except OSError as exc:
            raise ConfigError(
                f"sync.tls.cert_file / key_file: cannot load {tls.cert_file!r}: {_reason(exc)}"
            ) from None
    return context


def _reason(exc: OSError) -> str:
    """An ssl.SSLError's reason (PEM_LIB, ...) or an OSError's text, never a file's contents."""
    return str(getattr(exc, "reason", None) or exc.strerror or type(exc).__name__)
