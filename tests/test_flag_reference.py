"""docs/configuration.md's flag reference matches the command line: the same flags, and the defaults it writes.

The reference is every table under "## Flag reference" whose first column is
"flag". Each row names its flags in that column (`--x` and its `--no-x`
together); a row's "default" column, where the table has one, is checked
against the parser's default when that default is a value: `on`/`off` for a
switch, else the cell's first word (a number, a size such as 8MiB, a
string). A flag whose parser default is None gets its default worked out at
start-up, and the reference says in words what that is.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from server.__main__ import build_parser
from shared.config import parse_memory_size

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _reference_rows() -> list[tuple[tuple[str, ...], str | None]]:
    """(flags, default cell or None) for each row of the reference's tables."""
    text = REFERENCE.read_text()
    assert "\n## Flag reference\n" in text, f"{REFERENCE} has no '## Flag reference' section"
    section = text.split("\n## Flag reference\n", 1)[1].split("\n## ", 1)[0]
    rows: list[tuple[tuple[str, ...], str | None]] = []
    header: list[str] | None = None
    for line in section.split("\n"):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = [cell.lower() for cell in cells]
        elif not set("".join(cells)) <= set("-: "):  # not the |---| line
            if header[0] != "flag":
                continue
            default = cells[header.index("default")] if "default" in header else None
            rows.append((tuple(FLAG.findall(cells[0])), default))
    return rows


def _parser_flags() -> dict[str, argparse.Action]:
    return {flag: action for action in build_parser()._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def test_the_reference_lists_every_flag_of_the_parser_once() -> None:
    listed = [flag for flags, _ in _reference_rows() for flag in flags]
    parser_flags = set(_parser_flags())
    assert listed, f"no flag tables under '## Flag reference' in {REFERENCE}"
    assert sorted(parser_flags - set(listed)) == [], "flags the parser takes that the reference leaves out"
    assert sorted(set(listed) - parser_flags) == [], "flags the reference lists that the parser does not take"
    assert sorted({flag for flag in listed if listed.count(flag) > 1}) == [], "flags listed in more than one row"


def test_every_row_names_one_flag_and_its_negation_at_most() -> None:
    for flags, _ in _reference_rows():
        assert flags, "a row of the reference names no flag"
        assert {flag.replace("--no-", "--", 1) for flag in flags} == {flags[0]}, flags


def _as_written(cell: str, action: argparse.Action) -> object:
    """The default value a reference cell writes, in the parser's terms."""
    word = cell.replace("`", "").split()[0].rstrip(",;")
    if isinstance(action.default, bool):
        return {"on": True, "off": False}.get(word, cell)
    try:
        if action.type is parse_memory_size:
            return parse_memory_size(word)
        if isinstance(action.default, (int, float)):
            return float(word)
    except ValueError:
        return cell  # words where the parser has a value: never equal to it
    return word


def test_each_written_default_is_the_parsers() -> None:
    actions = _parser_flags()
    checked: list[str] = []
    wrong: list[str] = []
    for flags, cell in _reference_rows():
        action = actions.get(flags[0]) if flags else None
        if action is None or cell is None or action.default is None:
            continue  # no such flag (the test above says so), no default column, or a default worked out at start-up
        checked.append(flags[0])
        if not cell or _as_written(cell, action) != action.default:
            wrong.append(f"{flags[0]}: the reference says {cell!r}, the parser {action.default!r}")
    assert checked, "no default of the reference was checked"
    assert wrong == []
