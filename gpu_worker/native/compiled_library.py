"""The worker's C kernels as shared libraries: built at install for every CPU tier, loaded for this CPU's tier.

Owns the compiler command, the flags of each tier's build, where a build
lives and the choice of which one to load; knows nothing of what a library
computes. Imports nothing but the standard library and shared/cpu_tier.py,
so that setup.py can build with it where torch is not installed.

How it works. Installing the package (setup.py, editable or not) compiles
every kernel source once per tier build of this machine's architecture
(on x86: x86-64, avx2, avx512, avx512_bf16) into a file beside its source,
`cpu_decode.avx2.<key>.so`, the key a hash of the source, the headers
beside it and the flags, so that an edited source never loads a stale
binary. At run time load_or_warn() takes, for this process's tier
(shared/cpu_tier.py: the CPU's best, or $PAGEDSERVE_CPU_ISA's), its build
from beside the source; where there is none (a source checkout that was not
installed, or a source edited since), it compiles that build on first use
into a private cache directory, as a checkout's developer expects; where no
compiler can, it takes the best lower build that is installed; and where
there is none of those either, it warns once and the caller falls back on
torch. Installed builds are trusted as the package's Python files are.

A cached build's name carries the compiler's version too. It is written to a
temporary file and renamed over its final name (atomic on POSIX), so workers
building at once each load a whole library. Loading a library runs its code
and the cache's path is predictable, so the cache directory is created
private (0700), and a cached library is loaded only from a directory, and as
a file, that this user owns and no one else may write.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import stat
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.cpu_tier import CpuTier, current_tier, kernel_builds, tier_named

COMPILE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300
CACHE_DIR_MODE = 0o700
LIBRARY_MODE = 0o755
VERSION_TIMEOUT_S = 10
PACKAGE_DIR = Path(__file__).parents[1]  # gpu_worker/, which the kernel sources are named relative to
KERNEL_SOURCES = ("attention/cpu_decode.c", "attention/cpu_prefill.c", "models/cpu_fused.c", "models/cpu_linear.c",
                  "models/cpu_linear_bf16.c", "models/kernel_program.c",
                  "sampling/cpu_top_p.c", "sampling/cpu_token_mask.c", "sampling/cpu_draw.c")

logger = logging.getLogger("pagedserve.worker")


class LibraryBuildError(RuntimeError):
    """The library could not be compiled or loaded; the message says what was run and what it said."""

    def __init__(self, message: str, *, no_compiler: bool = False) -> None:
        super().__init__(message)
        self.no_compiler = no_compiler  # the compiler itself could not be run


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve"


def default_compiler() -> list[str]:
    """$CC (split like a shell would, so "ccache gcc" works), else gcc."""
    return shlex.split(os.environ.get("CC") or "gcc")


def build_flags(build: CpuTier) -> tuple[str, ...]:
    """The compiler flags of a tier's kernel build."""
    return (*COMPILE_FLAGS, *tier_named(build.kernel_build).compile_flags)


def source_key(source: Path, build: CpuTier) -> str:
    """16 hex digits of a hash over the source, the headers it may include (those next to it and those of the
    package's other kernel folders, such as attention/vector_math.h) and the build's flags."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted({*source.parent.glob("*.h"), *PACKAGE_DIR.glob("*/*.h")}):
        digest.update(b"\0" + str(header.relative_to(header.parents[1])).encode() + b"\0" + header.read_bytes())
    digest.update(b"\0" + " ".join(build_flags(build)).encode())
    return digest.hexdigest()[:16]


def installed_path(source: Path, build: CpuTier, package_dir: Path | None = None) -> Path:
    """Where the installed build of `source` for this tier lives: beside the source, or at the same place under
    package_dir (a build tree) when given."""
    name = f"{source.stem}.{build.kernel_build}.{source_key(source, build)}.so"
    if package_dir is None:
        return source.with_name(name)
    return package_dir / source.parent.relative_to(PACKAGE_DIR) / name


def install_build(source: Path, build: CpuTier, compiler: list[str], package_dir: Path | None = None) -> Path:
    """Compile `source` for the tier's build to its installed path (removing older builds of it); the path."""
    library = installed_path(source, build, package_dir)
    library.parent.mkdir(parents=True, exist_ok=True)
    for stale in library.parent.glob(f"{source.stem}.{build.kernel_build}.*.so"):
        if stale != library:
            stale.unlink()
    if not library.exists():
        _compile(source, library, compiler, build)
    return library


def install_all(compiler: list[str], package_dir: Path | None = None) -> list[Path]:
    """Every kernel source built for every tier build of this machine's architecture (setup.py's step)."""
    jobs = [(PACKAGE_DIR / source, build) for source in KERNEL_SOURCES for build in kernel_builds(platform.machine())]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: install_build(job[0], job[1], compiler, package_dir), jobs))


def load_library(source: Path, cache_dir: Path, compiler: list[str], tier: CpuTier | None = None) -> ctypes.CDLL:
    """The tier's build of `source` (this process's tier by default) from cache_dir, compiled there first unless a
    build for this compiler is there already."""
    build = tier or current_tier()
    try:
        cache_dir.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
    except OSError as error:
        raise LibraryBuildError(f"cannot create the cache directory {cache_dir}: {error}") from error
    _check_private(cache_dir)
    library = cache_dir / f"{source.stem}-{build.kernel_build}-{build_key(source, compiler, build)}.so"
    if not library.exists():
        _compile(source, library, compiler, build)
    _check_private(library)
    return _open(library)


def build_key(source: Path, compiler: list[str], tier: CpuTier | None = None) -> str:
    """16 hex digits of a hash over source_key's parts and the compiler's command and version."""
    build = tier or current_tier()
    digest = hashlib.sha256(source_key(source, build).encode())
    for part in (" ".join(compiler), _compiler_version(compiler)):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def load_kernel_library(source: Path, tier: CpuTier | None = None) -> ctypes.CDLL:
    """The tier's installed build of `source`; else that build compiled into the cache; else the best lower build
    installed; else LibraryBuildError (the cache's)."""
    build = tier or current_tier()
    installed = installed_path(source, build)
    if installed.exists():
        logger.info("%s: the %s build, installed", source.name, build.kernel_build)
        return _open(installed)
    try:
        library = load_library(source, default_cache_dir(), default_compiler(), build)
        logger.info("%s: the %s build, compiled into %s", source.name, build.kernel_build, default_cache_dir())
        return library
    except LibraryBuildError as error:
        lower = [tier for tier in kernel_builds(build.machine) if _is_below(tier, build)]
        for fallback in reversed(lower):
            if installed_path(source, fallback).exists():
                logger.warning("%s: no %s build is installed and none could be compiled (%s): loading the %s build",
                               source.name, build.kernel_build, error, fallback.name)
                return _open(installed_path(source, fallback))
        raise


def load_or_warn(source: Path, logger: logging.Logger, what: str, fallback: str,
                 tier: CpuTier | None = None) -> ctypes.CDLL | None:
    """load_kernel_library; None, after a warning on `logger` that `what` is unavailable and `fallback` is used
    instead, if no build can be loaded. A missing compiler is warned of once per process, for all kernels."""
    try:
        return load_kernel_library(source, tier)
    except LibraryBuildError as error:
        if not error.no_compiler:
            logger.warning("%s is unavailable, using %s: %s", what, fallback, error)
        elif _first_missing_compiler():
            logger.warning("the CPU kernels are not installed for this CPU and no C compiler could build them, so "
                           "the worker runs on torch's ops (slower); install the package with a C compiler present "
                           "(pip install .) or set $CC: %s", error)
        else:
            logger.info("%s is unavailable (no compiler), using %s", what, fallback)
        return None


def load_function_or_warn(source: Path, name: str, argtypes: list, logger: logging.Logger, what: str,
                          fallback: str, tier: CpuTier | None = None) -> Callable[..., int] | None:
    """The C function `name` of load_or_warn's library, its argument types set and an int status returned; None
    when the library is unavailable (after load_or_warn's warning)."""
    library = load_or_warn(source, logger, what, fallback, tier)
    if library is None:
        return None
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_missing_compiler_seen = False


def _first_missing_compiler() -> bool:
    """True the first time in this process that a kernel is missing for want of a compiler; False after."""
    global _missing_compiler_seen
    first, _missing_compiler_seen = not _missing_compiler_seen, True
    return first


def _is_below(tier: CpuTier, build: CpuTier) -> bool:
    return tier.needs < tier_named(build.kernel_build).needs


def _open(library: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise LibraryBuildError(f"could not load {library}: {error}") from error


def _compiler_version(compiler: list[str]) -> str:
    output = _run([*compiler, "--version"], VERSION_TIMEOUT_S)
    return output.splitlines()[0] if output else ""


def _check_private(path: Path) -> None:
    """LibraryBuildError unless path is owned by this user and writable by no one else (else they could swap the code)."""
    try:
        info = path.stat()
    except OSError as error:
        raise LibraryBuildError(f"cannot check who may write {path}: {error}") from error
    if info.st_uid != os.getuid():
        raise LibraryBuildError(f"refusing to load a library from {path}: it should be owned by this user "
                                f"(uid {os.getuid()}), but is owned by uid {info.st_uid}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryBuildError(f"refusing to load a library from {path}: it should be writable by its owner only, "
                                f"but its mode is {stat.filemode(info.st_mode)} (remove group and other write "
                                f"permission, or delete it to rebuild)")


def _compile(source: Path, library: Path, compiler: list[str], build: CpuTier) -> None:
    """Compile into a temporary file beside `library`, then rename it over `library`."""
    try:
        handle, partial = tempfile.mkstemp(dir=library.parent, prefix=f".{library.stem}-", suffix=".so.partial")
        os.close(handle)
    except OSError as error:
        raise LibraryBuildError(f"cannot write to the directory {library.parent}: {error}") from error
    try:
        _run([*compiler, *build_flags(build), "-o", partial, str(source)], COMPILE_TIMEOUT_S)
        try:
            os.chmod(partial, LIBRARY_MODE)  # whatever the umask: _check_private refuses a group-writable file
            os.replace(partial, library)
        except OSError as error:
            raise LibraryBuildError(f"cannot store the library at {library}: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _run(command: list[str], timeout_s: float) -> str:
    """Run a compiler command; its stdout, or LibraryBuildError with the command and its stderr."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except OSError as error:
        raise LibraryBuildError(f"`{shlex.join(command)}` could not run: {error}", no_compiler=True) from error
    except subprocess.TimeoutExpired as error:
        raise LibraryBuildError(f"`{shlex.join(command)}` could not run: {error}") from error
    if done.returncode != 0:
        raise LibraryBuildError(f"`{shlex.join(command)}` exited with {done.returncode}: {done.stderr.strip()[-2000:]}",
                                no_compiler=not done.stderr.strip() and command[-1] == "--version")
    return done.stdout
