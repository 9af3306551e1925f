"""What a `kvgate serve --processes N` child starts from: the group's config, and the last valid
version of each file the processes follow while they run.

A running process keeps its config as it read it at start, its workers as the last valid version
of a pool's `workers_file`, and its policy as the last valid version of the `policy_file`. A
child the supervisor restarts starts the same way, not from whatever the files hold at that
moment (an edited config reached only restarted children; a broken workers or policy file made
every restart exit 2, until the restart budget ran out and the supervisor stopped the healthy
processes too):
- the config is the one the supervisor loaded, written once into the group's folder (relative
  paths already resolved), and every child, first started or restarted, reads that copy;
- each followed file is checked by the supervisor as it changes (a stat every poll), and each
  valid version is copied into the group's folder. A child started while a file is invalid gets
  a config naming the copy instead, and follows the copy, which the supervisor replaces with each
  later valid version of the file; every other child follows the file itself.

With `--demo`, the children read the demo's config, written into the group's folder too
(`demo_config`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.auth import hash_api_key
from gateway.config import GatewayConfig, SecretsConfig
from gateway.config.base import ConfigError
from gateway.config.paths import relative_to
from gateway.file_discovery import MAX_FILE_BYTES, WorkersFileError, parse_workers
from gateway.policy_watch import MAX_POLICY_FILE_BYTES, load_policy_text
from policies.config import PolicyConfigError, parse_policy_yaml


def write_config(config: GatewayConfig, path: Path) -> Path:
    """`config` as a YAML file the children read (`gateway.config.load_config` reads it back equal)."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


_SECRET_ENV = "KVGATE_KEY_SECRET"


def demo_config(
    config: GatewayConfig, demo_key: str, folder: Path
) -> tuple[Path, GatewayConfig, dict[str, str]]:
    """The demo's config as a file the children read, and their environment. The demo's secret
    lives only in the supervisor's memory, so the children get a fresh one through the
    environment (the key hashes follow)."""
    secret = secrets.token_hex(32)
    tenants = [
        t.model_copy(update={"api_key_hashes": [hash_api_key(secret.encode(), demo_key)]})
        for t in config.tenants
    ]
    config = config.model_copy(
        update={"tenants": tenants, "secrets": SecretsConfig(key_hash_secret_env=_SECRET_ENV)}
    )
    return write_config(config, folder / "gateway.yaml"), config, {_SECRET_ENV: secret}


def _replace(path: Path, data: bytes) -> None:
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.replace(new, path)  # a child following the copy sees a whole new version, never half of one


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(slots=True)
class FollowedFile:
    """A file the processes follow, and the copy of its last valid version. `check` turns a
    version's bytes into what the copy holds, or raises `ValueError` saying why it is invalid.
    Invariant: `copy` exists once a version was valid; `error` is None when the version seen last
    is the copied one."""

    path: Path
    copy: Path
    check: Callable[[bytes], bytes]
    limit_bytes: int
    seen: tuple[int, int, int] | None = None
    error: str | None = "not read yet"

    def refresh(self) -> None:
        """Read the file if it changed since the last call; copy it if it is valid."""
        try:
            stamp = _stamp(self.path)
            if stamp == self.seen:
                return
            with open(self.path, "rb") as f:
                data = f.read(self.limit_bytes + 1)
            if _stamp(self.path) != stamp:
                return  # a writer is at work: read again at the next call
        except OSError as exc:
            self.seen, self.error = None, f"cannot read it: {exc.strerror}"
            return
        self.seen = stamp
        try:
            if len(data) > self.limit_bytes:
                raise ValueError(f"larger than {self.limit_bytes} bytes")
            copied = self.check(data)
        except (ValueError, UnicodeDecodeError) as exc:
            self.error = str(exc)
            return
        _replace(self.copy, copied)
        self.error = None


def _workers_check(roles: bool) -> Callable[[bytes], bytes]:
    def check(data: bytes) -> bytes:
        parse_workers(data.decode("utf-8"), roles=roles)  # raises WorkersFileError (a ValueError)
        return data

    return check


def _policy_check(folder: Path) -> Callable[[bytes], bytes]:
    def check(data: bytes) -> bytes:
        text = data.decode("utf-8")
        loaded = load_policy_text(text, folder)  # raises PolicyConfigError (a ValueError)
        if loaded.config == parse_policy_yaml(text):
            return data
        # Relative paths in it (the normalizer's) are the file's folder's, not the copy's.
        return yaml.safe_dump(loaded.config.model_dump(mode="json")).encode()

    return check


assert issubclass(WorkersFileError, ValueError) and issubclass(PolicyConfigError, ValueError)


class GroupFiles:
    """The group's config (written into `folder`) and the files its processes follow, with the
    copies of their last valid versions (module docstring)."""

    def __init__(self, config: GatewayConfig, folder: Path) -> None:
        # A config file given by a relative path leaves its paths relative to the working folder
        # (`load_config` resolves them against the file's folder, "."): the copy in `folder` must
        # not resolve them against its own.
        config = relative_to(config, Path.cwd())
        self.config = config
        self.folder = folder
        self.config_path = write_config(config, folder / "gateway.yaml")
        self.files: dict[str, FollowedFile] = {}  # by the config field that names the file
        for i, pool in enumerate(config.pools):
            if pool.workers_file is not None:
                path = Path(pool.workers_file.path)
                self.files[f"pools[{i}].workers_file"] = FollowedFile(
                    path,
                    folder / f"last-valid-workers-{i}.yaml",
                    _workers_check(pool.takes_roles),
                    MAX_FILE_BYTES,
                )
        if config.policy_file is not None:
            path = Path(config.policy_file)
            self.files["policy_file"] = FollowedFile(
                path, folder / "last-valid-policy.yaml", _policy_check(path.parent), MAX_POLICY_FILE_BYTES
            )

    def check_at_start(self) -> None:
        """Every followed file is valid now (else a `ConfigError` naming it): the first start
        fails once, here, and not once per process."""
        self.refresh()
        for field, followed in self.files.items():
            if followed.error is not None:
                raise ConfigError(f"{field}: {followed.path}: {followed.error}")

    def refresh(self) -> None:
        """Copy every followed file's new valid version (a stat each when nothing changed)."""
        for followed in self.files.values():
            followed.refresh()

    def invalid(self) -> dict[str, FollowedFile]:
        """The followed files whose current version is invalid, by field."""
        return {field: f for field, f in self.files.items() if f.error is not None}

    def config_for_start(self) -> tuple[Path, dict[str, FollowedFile]]:
        """The config a child starting now reads, and the files it follows as copies: the group's
        config, with each file that is invalid now replaced by the copy of its last valid version."""
        self.refresh()
        invalid = self.invalid()
        if not invalid:
            return self.config_path, {}
        config = self.config
        pools = list(config.pools)
        for i, pool in enumerate(pools):
            followed = invalid.get(f"pools[{i}].workers_file")
            if followed is not None and pool.workers_file is not None:
                workers_file = pool.workers_file.model_copy(update={"path": str(followed.copy)})
                pools[i] = pool.model_copy(update={"workers_file": workers_file})
        update: dict[str, object] = {"pools": pools}
        if "policy_file" in invalid:
            update["policy_file"] = str(invalid["policy_file"].copy)
        path = write_config(config.model_copy(update=update), self.folder / "gateway-last-valid.yaml")
        return path, invalid
