"""How the C kernels are built and found: a build per CPU tier installed beside each source, the build cache of a
checkout's developer, the choice of build at run time, and what happens without a compiler.

A kernel source copied into tmp_path stands for a checkout in which nothing was installed: no build sits beside
it until a test installs one. What each build computes is the kernel tests' business (test_cpu_*.py,
test_fused_ops.py, test_top_p_kernel.py, test_grammar.py), each run against every build this machine executes.
"""

from __future__ import annotations

import os
import platform
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.attention.cpu_decode import SOURCE, CpuDecodeKernel
from gpu_worker.native.compiled_library import (
    KERNEL_SOURCES,
    LibraryBuildError,
    build_key,
    default_compiler,
    install_build,
    installed_path,
    load_kernel_library,
    load_library,
)
from shared.cpu_tier import kernel_builds, tier_named

from helpers.cpu_tiers import KERNEL_TIERS, REPO, copy_checkout, tier_below

PACKAGE = REPO / "gpu_worker"


def copy_source(directory: Path, source: Path = SOURCE) -> Path:
    """source and the headers beside it (which it may include), copied into directory: a kernel not installed."""
    directory.mkdir(parents=True, exist_ok=True)
    for header in source.parent.glob("*.h"):
        (directory / header.name).write_bytes(header.read_bytes())
    (directory / source.name).write_bytes(source.read_bytes())
    return directory / source.name


def test_the_install_built_every_kernel_for_every_tier_of_this_architecture():
    builds = kernel_builds(platform.machine())
    assert [tier.name for tier in builds][:2] in (["x86-64", "avx2"], ["aarch64"], ["portable"])
    missing = [installed_path(PACKAGE / source, tier).name for source in KERNEL_SOURCES for tier in builds
               if not installed_path(PACKAGE / source, tier).exists()]
    assert not missing, f"not built at install (pip install -e . builds them): {missing}"


@pytest.mark.skipif(not Path("/usr/bin/objdump").exists(), reason="needs objdump to read the machine code")
@pytest.mark.parametrize("tier, register", [("x86-64", "%ymm"), ("avx2", "%zmm")])
def test_a_tier_build_uses_no_wider_registers_than_its_tier_has(tier, register):
    """The x86-64 build runs on any x86-64 CPU (no AVX), the avx2 build on any AVX2 one (no AVX-512)."""
    library = installed_path(SOURCE, tier_named(tier))
    code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert register not in code
    assert tier == "x86-64" or "%ymm" in code, "the avx2 build should use AVX2's registers"


def test_install_replaces_the_build_of_an_edited_source(tmp_path):
    source = copy_source(tmp_path / "checkout")
    tier = KERNEL_TIERS[0]
    first = install_build(source, tier, default_compiler())
    source.write_text(source.read_text() + "\n/* edited */\n")
    second = install_build(source, tier, default_compiler())
    assert first != second and not first.exists() and second.exists()
    assert [path.name for path in source.parent.glob("*.so")] == [second.name]


def test_an_installed_build_loads_without_a_compiler(monkeypatch, tmp_path):
    source = copy_source(tmp_path / "checkout")
    install_build(source, KERNEL_TIERS[-1], default_compiler())
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert CpuDecodeKernel(load_kernel_library(source, KERNEL_TIERS[-1])).max_group == 16
    assert not (tmp_path / "cache").exists(), "an installed build should need no cache"


@pytest.mark.skipif(len(KERNEL_TIERS) < 2, reason="needs a CPU with two kernel tiers")
def test_without_this_tiers_build_or_a_compiler_the_best_lower_build_loads(monkeypatch, tmp_path, caplog):
    source = copy_source(tmp_path / "checkout")
    best, lower = KERNEL_TIERS[-1], tier_below(KERNEL_TIERS[-1])
    install_build(source, KERNEL_TIERS[0], default_compiler())
    install_build(source, lower, default_compiler())
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="pagedserve.worker"):
        library = load_kernel_library(source, best)
    assert library._name == str(installed_path(source, lower))
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [source.name]
    assert f"no {best.name} build is installed" in caplog.records[0].getMessage()


def test_a_checkout_builds_into_its_cache_once_per_source(tmp_path):
    compiler, cache = default_compiler(), tmp_path / "cache"
    load_library(SOURCE, cache, compiler)
    (library,) = cache.glob("*.so")
    built_at = library.stat().st_mtime_ns
    load_library(SOURCE, cache, compiler)
    assert [path.name for path in cache.iterdir()] == [library.name]
    assert library.stat().st_mtime_ns == built_at, "a cached library was built again"
    edited = copy_source(tmp_path / "edited")
    edited.write_text(edited.read_text() + "\n/* edited */\n")
    load_library(edited, cache, compiler)
    assert len(list(cache.glob("*.so"))) == 2, "an edited source reused the old library"


def test_concurrent_builds_each_load_a_whole_library(tmp_path):
    script = ("import sys; from pathlib import Path; from gpu_worker.native.compiled_library import "
              "default_compiler, load_library; from gpu_worker.attention.cpu_decode import SOURCE, CpuDecodeKernel; "
              "print(CpuDecodeKernel(load_library(SOURCE, Path(sys.argv[1]), default_compiler())).max_group)")
    builds = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [build.communicate(timeout=300) for build in builds]
    assert [build.returncode for build in builds] == [0, 0, 0], [stderr for _, stderr in results]
    assert [stdout.strip() for stdout, _ in results] == ["16"] * 3
    assert [path.suffix for path in tmp_path.iterdir()] == [".so"], "a partial build was left behind"


@pytest.mark.parametrize("unsafe", [
    "group-writable library", "world-writable cache directory",
    pytest.param("library owned by another user", marks=pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown")),
])
def test_a_cached_library_others_could_write_is_refused(tmp_path, unsafe):
    cache_dir = tmp_path / "pagedserve"
    if unsafe == "world-writable cache directory":
        cache_dir.mkdir()
        cache_dir.chmod(0o777)
        message = rf"refusing to load a library from {re.escape(str(cache_dir))}: .*writable by its owner only, .*drwxrwxrwx"
    else:
        load_library(SOURCE, cache_dir, default_compiler())
        (library,) = cache_dir.glob(f"{SOURCE.stem}-*-{build_key(SOURCE, default_compiler())}.so")
        assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700 and stat.S_IMODE(library.stat().st_mode) == 0o755
        if unsafe == "group-writable library":
            library.chmod(0o775)
            message = rf"refusing to load a library from {re.escape(str(library))}: .*writable by its owner only, .*-rwxrwxr-x"
        else:
            os.chown(library, 65534, 65534)
            message = rf"refusing to load a library from {re.escape(str(library))}: .*owned by this user .*by uid 65534"
    with pytest.raises(LibraryBuildError, match=message):
        load_library(SOURCE, cache_dir, default_compiler())


def test_compile_error_names_the_command_and_its_output(tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return missing_name; }\n")
    with pytest.raises(LibraryBuildError, match=r"(?s)exited with 1: .*missing_name"):
        load_library(broken, tmp_path / "cache", default_compiler())
    assert not list((tmp_path / "cache").iterdir()), "a failed build left a file behind"


NOT_INSTALLED = """
import logging, sys
from pathlib import Path
from gpu_worker.native.compiled_library import load_or_warn
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
logger = logging.getLogger("pagedserve.worker")
print([load_or_warn(Path(source), logger, f"kernel {n}", "torch") for n, source in enumerate(sys.argv[1:])])
"""


def test_without_builds_or_a_compiler_one_warning_covers_every_kernel(tmp_path):
    sources = [copy_source(tmp_path / str(n), PACKAGE / source) for n, source in enumerate(KERNEL_SOURCES)]
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", NOT_INSTALLED, *map(str, sources)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str([None] * len(KERNEL_SOURCES))
    warnings = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, run.stderr
    assert "no C compiler could build them" in warnings[0] and "no-such-compiler" in warnings[0]
    assert "pip install ." in warnings[0]


GENERATE = """
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR
from shared.sampling_params import SamplingParams
engine = Engine(EngineConfig(model=str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", num_kv_blocks=64))
prompts = [[1, 40, 41, 42, 43], [1] + list(range(50, 90))]
print([c.token_ids for c in generate(engine, prompts, SamplingParams(max_tokens=12, temperature=0))])
"""


def test_a_checkout_without_builds_or_a_compiler_generates_what_the_kernels_do(tmp_path):
    """The engine on torch's ops, with one warning, where nothing was built and nothing can be."""
    checkout = copy_checkout(tmp_path / "checkout")
    runs = {}
    for name, directory, compiler in (("kernels", REPO, "gcc"), ("torch", checkout, str(tmp_path / "no-such-cc"))):
        env = {**os.environ, "CC": compiler, "XDG_CACHE_HOME": str(tmp_path / name)}
        runs[name] = subprocess.run([sys.executable, "-c", GENERATE], cwd=directory, env=env, capture_output=True,
                                    text=True, timeout=300)
        assert runs[name].returncode == 0, runs[name].stderr
    assert "unavailable" not in runs["kernels"].stderr and "no C compiler" not in runs["kernels"].stderr
    (warning,) = runs["torch"].stderr.strip().splitlines()  # logging's last-resort handler: warnings only
    assert "no C compiler could build them" in warning and "no-such-cc" in warning
    assert runs["kernels"].stdout == runs["torch"].stdout
