"""Relative paths in a gateway config file, resolved against the file's folder (`load_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

# Every field of the config that names a file or folder, as a path of attribute names (`pools`:
# each pool): a relative one is resolved against the config file's folder, wherever the gateway
# is started from.
_FILE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("policy_file",),
    ("secrets", "key_hash_secret_file"),
    ("decision_log", "path"),
    ("sync", "auth", "token_file"),
    ("sync", "auth", "password_file"),
    ("sync", "sentinel_auth", "token_file"),
    ("sync", "sentinel_auth", "password_file"),
    ("sync", "tls", "ca_file"),
    ("sync", "tls", "cert_file"),
    ("sync", "tls", "key_file"),
    ("pools", "worker_api_key_file"),
    ("pools", "workers_file", "path"),
    ("pools", "kubernetes", "token_file"),
    ("pools", "kubernetes", "ca_file"),
    ("pools", "normalizer", "tokenizer_dir"),
    ("pools", "normalizer", "chat_template_file"),
)


def relative_to(config: GatewayConfig, base: Path) -> GatewayConfig:
    """`config` with each relative file path of `_FILE_FIELDS` resolved against `base`."""
    for fields in _FILE_FIELDS:
        if fields[0] == "pools":
            pools = [_resolved(pool, fields[1:], base) for pool in config.pools]
            config = config.model_copy(update={"pools": pools})
        else:
            config = _resolved(config, fields, base)
    return config


def _resolved(model: Any, fields: tuple[str, ...], base: Path) -> Any:
    value = getattr(model, fields[0], None)
    if value is None:
        return model
    if len(fields) > 1:
        return model.model_copy(update={fields[0]: _resolved(value, fields[1:], base)})
    if not isinstance(value, str) or Path(value).is_absolute():
        return model
    return model.model_copy(update={fields[0]: str(base / value)})
