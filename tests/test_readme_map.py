"""The README's architecture map matches the tree: every package it names exists, and every package is named.

The map is the code block under "## Architecture". A folder it names
(`server/http/`, `models/`) must exist under the project; a file it names
(`service.py`) must exist in the package it is listed under; and every
package of server/, gpu_worker/, shared/ and tools/ must appear, so a new package
cannot be added without a place on the map.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("server", "gpu_worker", "shared", "tools")


def _architecture_map() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Architecture\n", 1)[1]
    return section.split("```", 2)[1]


def _packages() -> set[str]:
    """Every folder with an __init__.py under the top packages, as `server/http/`."""
    return {init.parent.relative_to(ROOT).as_posix() + "/" for top in TOP_PACKAGES
            for init in (ROOT / top).rglob("__init__.py")}


def test_every_package_is_on_the_map():
    text = _architecture_map()
    named = {path for path in re.findall(r"[\w/]+/", text)}
    missing = [package for package in sorted(_packages()) if package.rstrip("/") not in TOP_PACKAGES
               and not {package, package.split("/", 1)[1], package.rstrip("/").rsplit("/", 1)[1] + "/"} & named]
    assert missing == []


def test_every_folder_and_file_on_the_map_exists():
    text = _architecture_map()
    folders = set(re.findall(r"(?<![\w./])([a-z_]+(?:/[a-z_]+)*/)", text))  # not /dev/shm/: an absolute path
    tree = {d.relative_to(ROOT).as_posix() + "/" for top in TOP_PACKAGES for d in (ROOT / top).rglob("*")
            if d.is_dir()} | {top + "/" for top in TOP_PACKAGES}
    missing_folders = [f for f in sorted(folders) if not any(d == f or d.endswith("/" + f) for d in tree)]
    files = set(re.findall(r"\b([a-z_]+\.py)\b", text))
    sources = {p.name for top in TOP_PACKAGES for p in (ROOT / top).rglob("*.py")}
    assert (missing_folders, sorted(files - sources)) == ([], [])
