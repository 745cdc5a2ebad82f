"""The frontend's packages import downward only, the worker never imports the frontend, shared/ imports neither.

Layers of server/, bottom up: http and worker (neither knows the other),
generation (on both), api (on all three). state_store stands apart (api
uses it). The top level (server.py, metrics.py,
sd_notify.py, __main__.py) wires them and is imported by none of them.
Read from the source with ast, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_LAYERS = ("server.http", "server.worker", "server.generation", "server.api")
# What each package may import from the project, besides itself and shared.
ALLOWED = {
    "server.http": (),
    "server.worker": (),
    "server.generation": ("server.http", "server.worker"),
    "server.api": ("server.http", "server.worker", "server.generation", "server.state_store"),
    "server.state_store": (),
    "shared": (),
    "gpu_worker": (),
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name for name in names if name.split(".")[0] in ("server", "gpu_worker", "shared")}


def _package(module: str) -> str:
    for package in ALLOWED:
        if module == package or module.startswith(package + "."):
            return package
    return module


def _violations() -> list[str]:
    found = []
    for path in sorted(p for top in ("server", "gpu_worker", "shared") for p in (ROOT / top).rglob("*.py")):
        package = _package(_module(path))
        if package not in ALLOWED:
            continue  # the top level of server/: it wires everything
        allowed = (package, "shared", *ALLOWED[package])
        for name in sorted(_imports(path)):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_the_packages_are_found():
    assert {_package(_module(p)) for p in (ROOT / "server").rglob("*.py")} >= set(SERVER_LAYERS)


def test_no_package_imports_one_above_it_or_beside_it_out_of_turn():
    assert _violations() == []
