"""Test-wide setup that must happen before any test module imports torch or triton, the tiers of the suite,
the tiny checkpoint fixture, and the fixtures of the tests that run a real worker process.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU
tensors; the interpreter is chosen when triton is first imported, which
transformers and torch do early, so it is set here. Likewise the CPU tier:
under $PAGEDSERVE_CPU_ISA (PAGEDSERVE_CPU_ISA=avx2 tools/test.sh runs the
suite as an AVX2 machine would) torch and oneDNN are held to that tier
before anything imports torch, here and in every process a test starts.

Tiers: a test that starts a real process (the server, a worker, redis-server,
nginx) is marked e2e, one that is heavy in the test process slow, here and
only here (pytest_collection_modifyitems below); `pytest -m "not e2e and not
slow"` (tools/test.sh --fast) is the fast lane, the whole suite what CI runs.

The checkpoint and worker fixtures are module-scoped: each test module that
asks for them gets its own tiny checkpoint. A module that needs another shape
overrides `checkpoint`, building it with make_served_checkpoint too. Their
helpers are imported inside the fixtures so that a test run without them
never imports torch from here.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.config import EngineConfig
from shared.cpu_tier import CpuTier, limit_libraries
from shared.sampling_params import SamplingParams

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
limit_libraries(os.environ)

LONG_PROMPT = [11, 12, 13, 14, 15]
LONG_MAX_TOKENS = 70


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama with sharpened logits and a tokenizer (helpers/tiny_tokenizer.py), for the in-process
    Engine, a worker and the server alike."""
    from helpers.tiny_tokenizer import make_served_checkpoint  # torch, only for the modules that ask

    return make_served_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def accepts(tmp_path_factory):
    """accepts(grammar, text): whether `text`, as the test tokenizer's tokens, is a complete output of `grammar`."""
    import llguidance

    from helpers.tiny_tokenizer import write_tokenizer
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    tokenizer = llguidance.LLTokenizer(str(path / "tokenizer.json"))

    def check(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
    return check


@pytest.fixture(scope="module")
def engine_config(checkpoint) -> EngineConfig:
    from helpers.worker_helpers import tiny_engine_config

    return tiny_engine_config(checkpoint)


@pytest.fixture(scope="module")
def in_process_engine(engine_config):
    """The Engine a worker of engine_config runs, in the test process: the reference for what a worker sends."""
    from gpu_worker.engine.engine import Engine  # torch, in the test process only

    return Engine(engine_config)


@pytest.fixture(scope="module")
def long_case(in_process_engine) -> tuple[list[int], list[int]]:
    """A prompt and the in-process Engine's 70 greedy tokens for it (EOS ignored): long enough to be cut."""
    from gpu_worker.engine.generate import generate

    params = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0, ignore_eos=True)
    [completion] = generate(in_process_engine, [LONG_PROMPT], params)
    return LONG_PROMPT, completion.token_ids


# ---------------------------------------------------------------------------------------------- tiers
# Every test falls in one of three tiers, decided here and only here, from what its code uses:
#   e2e   it starts a real process: the server, a worker, redis-server or nginx (and every test of a *_e2e.py);
#   slow  in the test process but heavy: it runs another program (python -c, a compiler, a script, curl), runs
#         a whole model (the Engine, or transformers' as the reference), or checks a kernel's build for a tier
#         below this machine's best;
#   the rest is the fast lane, pytest -m "not e2e and not slow" (tools/test.sh --fast).
# The whole suite (tools/test.sh, what CI runs) is all three.

TESTS = Path(__file__).resolve().parent
# Names whose use starts a real process: the server (and its worker), redis-server, nginx, or a worker alone
# (an EngineClient spawns one when started); and the modules whose `python -m` is the server or a worker.
E2E_NAMES = frozenset({"start_server", "start_redis", "restart_redis", "start_nginx", "nginx_command", "EngineClient"})
E2E_MODULES = frozenset({"server", "gpu_worker"})
# Names whose use runs another program (a compiler: a kernel installed or built into a cache), or a whole model.
SLOW_NAMES = frozenset({"subprocess", "create_subprocess_exec", "create_subprocess_shell", "install_build",
                        "load_library", "Engine", "AutoModelForCausalLM"})


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    e2e, slow = Reach(E2E_NAMES, E2E_MODULES, scripts=True), Reach(SLOW_NAMES)
    for item in items:
        code = list(_code_of(item))
        if item.path.name.endswith("_e2e.py") or any(map(e2e.found_in, code)):
            item.add_marker(pytest.mark.e2e)
        elif any(map(slow.found_in, code)) or _checks_a_lower_tier(item):
            item.add_marker(pytest.mark.slow)


def _code_of(item: pytest.Item) -> Iterator[object]:
    """The test function, and the function of every fixture it uses, directly or through other fixtures."""
    yield getattr(item, "obj", None)
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in info.name2fixturedefs.get(name, ()) if info else ():
            yield fixturedef.func


def _checks_a_lower_tier(item: pytest.Item) -> bool:
    """A test over helpers/cpu_tiers.py's kernel tiers, for one below this machine's best (the one it serves on)."""
    from helpers.cpu_tiers import KERNEL_TIERS

    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(value, CpuTier) and value != KERNEL_TIERS[-1] for value in params.values())


class Reach:
    """Whether code of tests/ uses one of `names`, read from its compiled code, nested functions included: the
    names it uses (a function, fixture or class of tests/ among them is read in turn), the fixtures it asks for
    by name (request.getfixturevalue("name")), and its string constants: `python -m` on one of `modules` counts,
    and with `scripts`, so does a module-level string naming one of `names` (a script for `python -c`).
    Memoized: the suite's few hundred functions are each read once."""

    def __init__(self, names: frozenset[str], modules: frozenset[str] = frozenset(), scripts: bool = False) -> None:
        self.names, self.modules = names, modules
        self.script = re.compile(rf"\b(?:{'|'.join(sorted(names))})\b") if scripts else None
        self._known: dict[int, bool] = {}

    def found_in(self, obj: object) -> bool:
        while isinstance(obj, functools.partial):
            obj = obj.func
        obj = inspect.unwrap(obj) if callable(obj) else obj
        obj = getattr(obj, "__func__", obj)  # a test method: its function
        if not _is_in_tests(obj):
            return False
        if getattr(obj, "__name__", None) in self.names:  # reached through another name, e.g. a partial
            return True
        if id(obj) not in self._known:
            self._known[id(obj)] = False  # a cycle reads as not found; the outer call decides
            self._known[id(obj)] = any(self._found_in_code(code, getattr(function, "__globals__", {}))
                                       for function in _functions(obj) for code in _nested(function.__code__))
        return self._known[id(obj)]

    def _found_in_code(self, code: types.CodeType, globals_: dict) -> bool:
        if self.names.intersection(code.co_names):
            return True
        strings = set(_strings(code.co_consts))
        if "-m" in strings and strings & self.modules:  # [sys.executable, "-m", "server", ...]
            return True
        names = list(code.co_names)
        if "getfixturevalue" in names:
            names += strings  # the fixtures it asks for, where its module defines them
        for name in names:
            value = globals_.get(name)
            if self.script and isinstance(value, str) and self.script.search(value):
                return True
            if callable(value) and self.found_in(value):
                return True
        return False


def _is_in_tests(obj: object) -> bool:
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and _is_a_module_of_tests(module)


@functools.cache
def _is_a_module_of_tests(name: str) -> bool:
    path = getattr(sys.modules.get(name), "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(TESTS)


def _functions(obj: object) -> Iterator[types.FunctionType]:
    """A function itself; a class's methods, static and class methods and properties."""
    if inspect.isfunction(obj):
        yield obj
    elif inspect.isclass(obj):
        for attribute in vars(obj).values():
            for candidate in ((attribute.fget, attribute.fset) if isinstance(attribute, property)
                              else (getattr(attribute, "__func__", attribute),)):
                if inspect.isfunction(candidate):
                    yield candidate


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _strings(consts: tuple) -> Iterator[str]:
    for const in consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, (tuple, frozenset)):
            yield from _strings(tuple(const))
