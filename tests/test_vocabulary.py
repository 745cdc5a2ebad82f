"""Each fact the frontend and the worker share has one home: no other module defines it again.

A grep over the project's packages: the old spellings (a second SEED_BITS, a
finish reason as a module constant, a heartbeat interval in the worker loop,
restart-policy defaults outside RestartPolicy, a flag's default written
again beside its config field's, the default address in more than one
module, an environment variable that tells the workers what their command
line should, "device auto" decided in more than one function) fail here by
file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from server.__main__ import build_parser
from server.server import ServerConfig
from shared.config import DEFAULT_CPU_KV_CACHE_MEMORY, TARGET_ITL_AUTO_FACTOR, EngineConfig, field_defaults, format_memory_size
from shared.worker_launch import device_probe_command

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "gpu_worker", "shared", "tools")

HOMES = {
    r"class FinishReason\b": "shared/vocabulary.py",
    r"SEED_BITS\s*[:=]": "shared/vocabulary.py",
    r"HEARTBEAT_INTERVAL_S\s*[:=]": "shared/vocabulary.py",
    r"MIN_HANG_TIMEOUT_S\s*[:=]": "shared/vocabulary.py",
    r"RETRY_AFTER_S\s*[:=]": "server/http/errors.py",
    r"class RestartPolicy\b": "server/worker/restart_policy.py",
    r"DEFAULT_HOST\s*[:=]": "server/http/server.py",
    r"DEFAULT_PORT\s*[:=]": "server/http/server.py",
    r"RESOLVED_DEVICES\s*[:=]": "shared/config.py",
    r"def select_device\b": "gpu_worker/runner/model_runner.py",  # "auto" decided, in the worker and for the server
    r"(async )?def resolve_device\b": "server/worker/sharing.py",  # the server's one call of it, before any worker starts
    r"def device_probe_command\b": "shared/worker_launch.py",
    r"DEFAULT_CPU_KV_CACHE_MEMORY\s*[:=]": "shared/config.py",  # the worker's default and the help's
    r"TARGET_ITL_AUTO_FACTOR\s*[:=]": "shared/config.py",
}
# The flags of a command line and the dataclass each one fills: a flag whose dest is a field defaults to the field's.
FLAG_HOMES = {"shared/engine_args.py": EngineConfig, "server/__main__.py": ServerConfig}
# The default address, written out: only DEFAULT_HOST and DEFAULT_PORT may.
ADDRESS_LITERAL = re.compile(r"""["']127\.0\.0\.1["']|(?<![\d.:])8000(?![\d.])""")
# How the frontend once told its workers about --debug-memory: an environment variable they inherited.
DEBUG_MEMORY_ENV = re.compile(r"PAGEDSERVE_DEBUG_MEMORY|DEBUG_MEMORY_ENV")
# Where "auto" may be compared against: the one function that decides it, and the server's one call of it.
AUTO_DEVICE_DECIDERS = {"gpu_worker/runner/model_runner.py": "select_device", "server/worker/sharing.py": "resolve_device"}

# A finish reason spelled as a module constant of its own: `STOP = "stop"`, `ABORT = "abort"`, `FAILED = "error"`.
FINISH_REASON_CONSTANT = re.compile(r"""^[A-Z_]+\s*=\s*["'](stop|length|abort)["']|"""
                                    r"""^[A-Z_]*(FAILED|OUTCOME|REASON)[A-Z_]*\s*=\s*["']error["']""")
# A finish reason compared or assigned as a literal: `finish_reason == "stop"`, `append([], None, "abort")`.
FINISH_REASON_LITERAL = re.compile(r"""finish_reason\s*(==|!=|=)\s*["'](stop|length|abort|error)["']|"""
                                   r"""append\(\[\], None, ["'](stop|length|abort|error)["']\)""")
# Restart-policy defaults written as keyword defaults outside RestartPolicy.
POLICY_DEFAULT = re.compile(r"\b(hang_timeout|start_timeout|max_request_restarts|max_worker_restarts|restart_window)"
                            r"\s*:\s*(float|int)\s*=\s*[\d.]+")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _lines(path: Path) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(path.read_text().splitlines(), start=1)
            if not line.lstrip().startswith("#")]


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert set(HOMES.values()) <= names, "a home moved: update HOMES"


def test_each_shared_fact_is_defined_only_in_its_home():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for pattern, home in HOMES.items()
              for path in _sources() if path.relative_to(ROOT).as_posix() != home
              for i, line in _lines(path) if re.match(rf"\s*{pattern}", line)]
    assert strays == []


def test_each_home_defines_its_fact():
    for pattern, home in HOMES.items():
        assert any(re.match(rf"\s*{pattern}", line) for _, line in _lines(ROOT / home)), (pattern, home)


def test_finish_reasons_are_spelled_by_the_enum():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() if path.relative_to(ROOT).as_posix() != "shared/vocabulary.py"
              for i, line in _lines(path) if FINISH_REASON_CONSTANT.match(line) or FINISH_REASON_LITERAL.search(line)]
    assert strays == []


def test_restart_policy_defaults_are_written_once():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() if path.relative_to(ROOT).as_posix() != "server/worker/restart_policy.py"
              for i, line in _lines(path) if POLICY_DEFAULT.search(line)]
    assert strays == []


def _add_argument_calls(path: Path) -> list[tuple[ast.Call, str]]:
    """Each parser.add_argument(...) call of the module that names a --flag, with the flag's dest."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")]
            dest = next((kw.value.value for kw in node.keywords if kw.arg == "dest"), None)
            if flags:
                calls.append((node, dest or flags[0].removeprefix("--").replace("-", "_")))
    return calls


@pytest.mark.parametrize("module", sorted(FLAG_HOMES))
def test_a_flag_takes_its_default_from_its_config_field_never_a_second_literal(module):
    defaults = field_defaults(FLAG_HOMES[module])
    calls = [(node, dest) for node, dest in _add_argument_calls(ROOT / module) if dest in defaults]
    assert calls, f"no flag of {module} sets a {FLAG_HOMES[module].__name__} field"
    strays = [f"{module}:{node.lineno}: --{dest.replace('_', '-')} default={ast.unparse(kw.value)}"
              for node, dest in calls for kw in node.keywords
              if kw.arg == "default" and isinstance(kw.value, ast.Constant)]
    missing = [f"{module}:{node.lineno}: --{dest.replace('_', '-')} has no default=" for node, dest in calls
               if not any(kw.arg == "default" for kw in node.keywords)]
    assert strays + missing == []
    args = vars(build_parser().parse_args([]))
    assert {dest: args[dest] for _, dest in calls} == {dest: defaults[dest] for _, dest in calls}


def test_the_help_states_the_constants_it_is_built_from():
    helps = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    stated = {"--kv-cache-memory": f"default: {format_memory_size(DEFAULT_CPU_KV_CACHE_MEMORY)} on CPU",
              "--target-itl-ms": f"default: {TARGET_ITL_AUTO_FACTOR:g}x the step time"}
    assert {flag: text in helps[flag] for flag, text in stated.items()} == dict.fromkeys(stated, True)
    literal_help = [part.value for node, _ in _add_argument_calls(ROOT / "shared/engine_args.py")
                    for kw in node.keywords if kw.arg == "help"
                    for part in ast.walk(kw.value) if isinstance(part, ast.Constant) and isinstance(part.value, str)]
    assert [text for text in literal_help if re.search(r"\d+(\.\d+)?x\b|\dGiB on", text)] == [], \
        "a constant restated in the help as a literal"


def test_the_default_address_is_written_once():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() if path.relative_to(ROOT).parts[0] == "server"
              and path.relative_to(ROOT).as_posix() != "server/http/server.py"
              for i, line in _lines(path) if ADDRESS_LITERAL.search(line)]
    assert strays == []
    assert (ServerConfig.__dataclass_fields__["host"].default, ServerConfig.__dataclass_fields__["port"].default) == \
        (build_parser().get_default("host"), build_parser().get_default("port"))


def test_debug_memory_reaches_the_worker_on_its_command_line_not_through_the_environment():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() for i, line in _lines(path) if DEBUG_MEMORY_ENV.search(line)]
    assert strays == []


def test_device_auto_is_decided_in_one_function():
    strays = []
    for path in _sources():
        module = path.relative_to(ROOT).as_posix()
        if module.startswith("tools/"):
            continue
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(operand, ast.Constant) and operand.value == "auto"
                                                     for operand in (node.left, *node.comparators)):
                inside = [f.name for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
                if AUTO_DEVICE_DECIDERS.get(module) not in inside:
                    strays.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert strays == []
    assert "select_device('auto')" in device_probe_command()[-1], "the server asks the worker's own function"
