"""Both processes' packages import downward only, the worker never imports the frontend, shared/ imports neither.

Layers of server/, bottom up: http and worker (neither knows the other),
generation (on both), api (on all three). state_store stands apart (api
uses it). The top level (server.py, metrics.py,
sd_notify.py, __main__.py) wires them and is imported by none of them.

Layers of gpu_worker/, bottom up: native (the compiled kernels' loader,
threads, row ladder); attention on native; models on both; kv and sampling
(neither knows the other); scheduling on kv; runner on all of those but
knows of scheduling only scheduler_output.py; engine on all; process (the
loop around the engine) on top. sequence.py, the one object every stage
shares, is below them all; __main__.py wires the process.
Read from the source with ast, so a lazy import inside a function counts too;
an import under `if TYPE_CHECKING:` (for annotations only) does not.

And the frontend process never loads torch: its modules that a request passes
through, and the worker's client, are imported in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "gpu_worker.native": (),
    "gpu_worker.attention": ("gpu_worker.native",),
    "gpu_worker.models": ("gpu_worker.native", "gpu_worker.attention"),
    "gpu_worker.kv": ("gpu_worker.sequence",),
    "gpu_worker.sampling": ("gpu_worker.native", "gpu_worker.sequence"),
    "gpu_worker.scheduling": ("gpu_worker.native", "gpu_worker.kv", "gpu_worker.sequence"),
    "gpu_worker.runner": ("gpu_worker.native", "gpu_worker.attention", "gpu_worker.models", "gpu_worker.kv",
                          "gpu_worker.sampling", "gpu_worker.scheduling.scheduler_output"),
    "gpu_worker.engine": ("gpu_worker.native", "gpu_worker.models", "gpu_worker.kv", "gpu_worker.sampling",
                          "gpu_worker.scheduling", "gpu_worker.runner", "gpu_worker.sequence"),
    "gpu_worker.process": ("gpu_worker.engine", "gpu_worker.sequence"),
    "gpu_worker.sequence": (),
}
# What the frontend imports on a request's way through it, and its side of the worker's channel: none loads torch.
FRONTEND_MODULES = ("server.api.completions.handlers", "server.generation.tokenizer", "server.generation.chat_template",
                    "server.worker.engine_client", "server.worker.runtime_dir")
WORKER_STAGES = ("gpu_worker.native", "gpu_worker.attention", "gpu_worker.models", "gpu_worker.kv", "gpu_worker.sampling",
                 "gpu_worker.scheduling", "gpu_worker.runner", "gpu_worker.engine", "gpu_worker.process")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _nodes(tree: ast.AST):
    """Every node of the tree but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _nodes(node)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in _nodes(ast.parse(path.read_text())):
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
            continue  # the top level of server/ and gpu_worker/__main__.py: they wire everything
        allowed = (package, "shared", *ALLOWED[package])
        for name in sorted(_imports(path)):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_the_packages_are_found():
    assert {_package(_module(p)) for p in (ROOT / "server").rglob("*.py")} >= set(SERVER_LAYERS)
    assert {_package(_module(p)) for p in (ROOT / "gpu_worker").rglob("*.py")} >= set(WORKER_STAGES)


def test_every_worker_module_sits_in_a_stage():
    """Nothing new lands on the worker's top level: a module there joins a stage or becomes one."""
    top = sorted(p.name for p in (ROOT / "gpu_worker").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "sequence.py"]


def test_no_package_imports_one_above_it_or_beside_it_out_of_turn():
    assert _violations() == []


def test_the_frontend_never_imports_torch():
    code = f"import sys, {', '.join(FRONTEND_MODULES)}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
