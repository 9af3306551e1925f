"""The shipped traces: their names, their files against NOTICE, and the commands that take them."""

from __future__ import annotations

import argparse
import hashlib
import lzma
import re
from pathlib import Path
from types import ModuleType

import pytest

from loadtest import bench_routing
from loadtest.simulator import cli as simulate_cli
from loadtest.traces.catalog import DATA_DIR, SHIPPED_TRACES, resolve_trace
from loadtest.traces.load import load_trace
from loadtest.traces.mooncake import TraceFormatError

REPO_ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(
    r"^(?P<file>loadtest/traces/data/\S+)\n"
    r"  source:  (?P<source>https://github\.com/\S+)\n"
    r"  path:    (?P<path>\S+)\n"
    r"  commit:  (?P<commit>[0-9a-f]{40})\n"
    r"  sha256:  (?P<sha256>[0-9a-f]{64})\n"
    r"  license: Apache-2\.0, .*?(?P<license>loadtest/traces/data/\S+)$",
    re.MULTILINE,
)


def _notice_entries() -> dict[str, re.Match[str]]:
    text = (REPO_ROOT / "NOTICE").read_text()
    return {m["file"]: m for m in _ENTRY.finditer(text)}


def test_every_shipped_file_matches_its_notice_entry() -> None:
    entries = _notice_entries()
    shipped = {f"loadtest/traces/data/{file}" for file in SHIPPED_TRACES.values()}
    assert set(entries) == shipped
    for rel, entry in entries.items():
        data = lzma.decompress((REPO_ROOT / rel).read_bytes())
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], rel
        # The upstream file name, compressed: the path in NOTICE is the file that was copied.
        assert Path(rel).name == Path(entry["path"]).name + ".xz"
        license_text = (REPO_ROOT / entry["license"]).read_text()
        assert "Apache License" in license_text and "Version 2.0" in license_text


def test_names_resolve_to_the_package_data() -> None:
    for name, file in SHIPPED_TRACES.items():
        path = resolve_trace(name)
        assert path == DATA_DIR / file and path.is_file()
    formats = {name: load_trace(name).trace_format for name in SHIPPED_TRACES}
    assert formats == {
        "mooncake-conversation": "mooncake",
        "mooncake-synthetic": "mooncake",
        "kvct-agent": "kv-cache-tester",
    }
    assert len(load_trace("mooncake-synthetic").requests) == 3993


def test_a_path_still_works_and_an_unknown_name_lists_the_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "kvct-agent"
    f.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    assert resolve_trace(f) == f  # a Path is always a path
    monkeypatch.chdir(tmp_path)
    assert resolve_trace("kvct-agent") == DATA_DIR / SHIPPED_TRACES["kvct-agent"]  # the name wins
    assert load_trace("./kvct-agent").trace_format == "mooncake"  # ... and ./NAME reads the file
    with pytest.raises(TraceFormatError, match="no such trace file") as err:
        load_trace("mooncake-conversations")
    for name in SHIPPED_TRACES:
        assert name in str(err.value)


@pytest.mark.parametrize("module", [simulate_cli, bench_routing])
def test_every_trace_option_names_the_shipped_traces(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a name
    parser = argparse.ArgumentParser(prog="kvgate")
    module.add_arguments(parser)
    help_text = parser.format_help()
    for name in SHIPPED_TRACES:
        assert name in help_text
