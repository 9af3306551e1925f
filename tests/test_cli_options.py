"""`kvgate --version`, and help text on every option of every subcommand."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_package_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--version"], capture_output=True, text=True, check=True
    )
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert proc.stdout.strip() == f"kvgate {expected}"


def _options(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    """Every action of `parser` and of the parsers below it, with the command line that reaches it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for pseudo in action._choices_actions:  # the one-line summary of each subcommand
                yield f"{path} {pseudo.dest}", pseudo
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def _command_lines() -> list[list[str]]:
    return [[name] for name in cli.COMMANDS] + [["bench", name] for name in cli.BENCHMARKS]


@pytest.mark.parametrize("argv", _command_lines(), ids=" ".join)
def test_every_option_has_help(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The parser loads a subcommand's options only when the command line names it.
    monkeypatch.setattr(sys, "argv", ["kvgate", *argv])
    parser, chosen = cli._build_parser()
    assert " ".join(argv) in chosen
    options = list(_options(parser, "kvgate"))
    assert len(options) > 10
    missing = [
        f"{path} {'/'.join(a.option_strings) or a.dest}"
        for path, a in options
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert missing == []


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented", help="yes")
    parser.add_argument("--bare")
    helps = {"/".join(a.option_strings): a.help for _, a in _options(parser, "p")}
    assert helps == {"--documented": "yes", "--bare": None}
