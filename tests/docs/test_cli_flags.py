"""The docs name only options that their commands have, and the emulator's flag table lists every
option of `python -m loadtest.emulator` with its default."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gateway import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EMULATOR = "loadtest.emulator.cli"
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def parser_of(module: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli._load(cli.Command(module, "")).add_arguments(parser)
    return parser


def commands() -> dict[str, set[str]]:
    """Each command as the docs write it (`serve`, `bench pd`, `loadtest.emulator`) and its options."""
    modules = {name: cmd.module for name, cmd in cli.COMMANDS.items()}
    modules |= {f"bench {name}": cmd.module for name, cmd in cli.BENCHMARKS.items()}
    modules["loadtest.emulator"] = EMULATOR
    return {
        name: {s for action in parser_of(module)._actions for s in action.option_strings}
        for name, module in modules.items()
    }


def code_lines(text: str) -> list[str]:
    """Where the docs write commands: lines of code blocks (fenced or indented), inline code."""
    fenced = [line for block in FENCED.findall(text) for line in block.splitlines()]
    indented = re.findall(r"^    (\S.*)$", text, re.M)
    return fenced + indented + re.findall(r"`([^`\n]+)`", FENCED.sub("", text))


def table_rows(text: str) -> list[list[str]]:
    """The cells of each table row, split on the table's pipes (not on the escaped `a\\|b`)."""
    return [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def test_every_option_a_doc_gives_a_command_is_the_commands() -> None:
    options = commands()
    names = "|".join(re.escape(name) for name in sorted(options, key=len, reverse=True))
    command = re.compile(rf"(?:kvgate |python -m )({names})(?![\w.-])")
    wrong = []
    for page in PAGES:
        for line in code_lines(page.read_text()):
            for found in command.finditer(line):
                # The command's own words: up to the next command, pipe or shell separator.
                words = re.split(r"kvgate |python -m |[|;&]", line[found.end() :])[0]
                name = found.group(1)
                wrong += [f"{page.name}: {name} {o}" for o in OPTION.findall(words) if o not in options[name]]
    assert wrong == []


def test_the_emulators_flag_table_lists_every_option_and_its_default() -> None:
    stated = {}
    for cells in table_rows((ROOT / "docs" / "emulator.md").read_text()):
        if cells[0].startswith("`--"):
            stated |= dict.fromkeys(re.findall(r"`(--[a-z][a-z0-9-]*)", cells[0]), cells[1].strip("`"))
    actions = [a for a in parser_of(EMULATOR)._actions if "--help" not in a.option_strings]
    assert sorted({a.option_strings[0] for a in actions} - set(stated)) == []
    differ = []
    for action in actions:
        flag = action.option_strings[0]
        number = re.fullmatch(r"[\d,.]+", stated[flag])
        if number and float(stated[flag].replace(",", "")) != action.default:
            differ.append(flag)
        if action.choices and stated[flag] != action.default:
            differ.append(flag)
    assert differ == []
