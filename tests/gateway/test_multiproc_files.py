"""`gateway.multiproc_files`: the config a `--processes` child reads is the one the supervisor
loaded, and a workers or policy file that is invalid when a child starts is replaced, in that
child's config, by the copy of its last valid version, which follows the file's later valid ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.auth import hash_api_key
from gateway.config import load_config
from gateway.config.base import ConfigError
from gateway.multiproc_files import GroupFiles
from tests.support.gateway_config import write_gateway_config


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _group(tmp_path: Path) -> tuple[GroupFiles, Path, Path]:
    conf, group = tmp_path / "conf", tmp_path / "group"
    conf.mkdir()
    group.mkdir()
    workers, policy = conf / "workers.yaml", conf / "policy.yaml"
    _write(workers, "- http://127.0.0.1:9\n")
    _write(policy, "policy: round_robin\n")
    pool = {"name": "p", "models": ["m"], "workers_file": {"path": "workers.yaml"}}
    tenants = [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}]
    path = write_gateway_config(conf / "gw.yaml", [pool], tenants, policy_file="policy.yaml")
    return GroupFiles(load_config(path), group), workers, policy


def test_children_read_the_config_the_supervisor_loaded(tmp_path: Path) -> None:
    files, _, _ = _group(tmp_path)
    files.check_at_start()
    (tmp_path / "conf" / "gw.yaml").write_text("not: [a config\n")  # edited since
    path, copies = files.config_for_start()
    assert path == files.config_path and copies == {}
    assert load_config(path) == files.config  # relative paths were resolved against conf/


def test_an_invalid_file_is_replaced_by_its_last_valid_version(tmp_path: Path) -> None:
    files, workers, policy = _group(tmp_path)
    files.check_at_start()
    _write(workers, "- [oops\n")
    _write(policy, "policy: nosuch\n")
    path, copies = files.config_for_start()
    assert set(copies) == {"pools[0].workers_file", "policy_file"}
    config = load_config(path)
    copy = config.pools[0].workers_file
    assert copy is not None and Path(copy.path).read_text() == "- http://127.0.0.1:9\n"
    assert config.policy_file is not None and Path(config.policy_file).read_text() == "policy: round_robin\n"
    # A later valid version reaches the copy; an invalid one never does.
    _write(workers, "- http://127.0.0.1:10\n")
    files.refresh()
    assert Path(copy.path).read_text() == "- http://127.0.0.1:10\n"
    assert files.config_for_start()[1].keys() == {"policy_file"}


def test_an_invalid_file_at_the_start_stops_it_once(tmp_path: Path) -> None:
    files, _, policy = _group(tmp_path)
    _write(policy, "policy: nosuch\n")
    with pytest.raises(ConfigError, match=r"policy_file: .*policy\.yaml: "):
        files.check_at_start()


def test_a_config_given_by_a_relative_path_keeps_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvgate serve --config gw.yaml --processes 2` from the config's folder: its relative paths
    stay relative to that folder, not to the copy's."""
    files, workers, _ = _group(tmp_path)
    monkeypatch.chdir(tmp_path / "conf")
    files = GroupFiles(load_config("gw.yaml"), tmp_path / "group")
    files.check_at_start()
    config = load_config(files.config_path)
    assert config.pools[0].workers_file is not None
    assert Path(config.pools[0].workers_file.path) == workers
    assert config.policy_file == str(tmp_path / "conf" / "policy.yaml")
