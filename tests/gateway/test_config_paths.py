"""Relative paths in a config file are resolved against the file's folder (`gateway.config.paths`,
docs/config.md "Fields"), whichever folder the gateway is started from."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config import GatewayConfig, load_config
from gateway.config.paths import _FILE_FIELDS
from gateway.sync.link import open_link
from gateway.sync.sentinel_link import SentinelLink

TENANTS = 'tenants: [{name: t, api_key_hashes: ["hmac-sha256:' + "0" * 64 + '"]}]\n'
POOLS = "pools: [{name: p, models: [m], workers: ['http://127.0.0.1:9']}]\n"
SENTINEL_URL = "redis+sentinel://127.0.0.1:9/m"


async def _ignore(data: bytes) -> None:
    return None


@pytest.mark.parametrize(
    ("sentinel_auth", "field"),
    [
        ("{token_file: s/sentinel}", "token_file"),
        ("{user: watcher, password_file: s/sentinel}", "password_file"),
    ],
)
def test_the_sentinels_secret_file_is_read_beside_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sentinel_auth: str, field: str
) -> None:
    (tmp_path / "conf" / "s").mkdir(parents=True)
    (tmp_path / "conf" / "s" / "sentinel").write_text("sentinel-secret\n")
    config = tmp_path / "conf" / "gw.yaml"
    config.write_text(TENANTS + POOLS + f"sync: {{url: '{SENTINEL_URL}', sentinel_auth: {sentinel_auth}}}\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    sync = load_config(config).sync
    assert sync.sentinel_auth is not None
    assert getattr(sync.sentinel_auth, field) == str(tmp_path / "conf" / "s" / "sentinel")
    link = open_link(sync, "me", _ignore)
    assert isinstance(link, SentinelLink) and link.sentinels._password == "sentinel-secret"


def _file_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every field of `model`'s tree that names a file or folder: `*_file`, `*_dir`, `path`."""
    found = []
    for name, info in model.model_fields.items():
        fields = (*prefix, name)
        nested = [a for a in (info.annotation, *typing.get_args(info.annotation)) if _is_model(a)]
        if nested:
            found += [f for sub in nested for f in _file_fields(sub, fields)]
        elif name.endswith(("_file", "_dir")) or name == "path":
            found.append(fields)
    return found


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def test_every_field_that_names_a_file_is_resolved() -> None:
    # `pools` is a list of PoolConfig: its fields are listed as each pool's.
    fields = _file_fields(GatewayConfig)
    assert ("sync", "sentinel_auth", "token_file") in fields  # the walk reaches optional blocks
    assert set(fields) == set(_FILE_FIELDS)
