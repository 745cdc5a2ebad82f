"""Build a C source of this package into a shared library on first use, cache it, and load it with ctypes.

Owns the compiler command, the cache directory and the library's file name;
knows nothing of what the library computes.

How it works: the library's file name carries a hash of everything that
shapes the machine code — the source and the headers beside it, the
compiler's version, the flags and the CPU (-march=native targets the machine
it runs on) — so a changed source or header, an upgraded compiler or a
copied cache directory on another CPU builds anew instead of loading a stale
or illegal binary. A build writes a temporary file
in the cache directory and renames it over the final name (atomic on POSIX),
so workers building at once each end up loading a whole library. Loading a
library runs its code, and its path is predictable, so the cache directory is
created private (0700) and a library is loaded only from a directory, and as
a file, that this user owns and no one else may write. Anything that goes
wrong raises LibraryBuildError, for the caller to fall back on.
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
from pathlib import Path

COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120
CACHE_DIR_MODE = 0o700
LIBRARY_MODE = 0o755
VERSION_TIMEOUT_S = 10


class LibraryBuildError(RuntimeError):
    """The library could not be compiled or loaded; the message says what was run and what it said."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve"


def default_compiler() -> list[str]:
    """$CC (split like a shell would, so "ccache gcc" works), else gcc."""
    return shlex.split(os.environ.get("CC") or "gcc")


def load_library(source: Path, cache_dir: Path, compiler: list[str]) -> ctypes.CDLL:
    """The compiled `source`, built into cache_dir unless a build for this compiler and CPU is there already."""
    try:
        cache_dir.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
    except OSError as error:
        raise LibraryBuildError(f"cannot create the cache directory {cache_dir}: {error}") from error
    _check_private(cache_dir)
    library = cache_dir / f"{source.stem}-{build_key(source, compiler)}.so"
    if not library.exists():
        _build(source, library, compiler)
    _check_private(library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise LibraryBuildError(f"could not load {library}: {error}") from error


def load_or_warn(source: Path, logger: logging.Logger, what: str, fallback: str) -> ctypes.CDLL | None:
    """load_library into the default cache with the default compiler; None, after one warning on `logger` that
    `what` is unavailable and `fallback` is used instead, if it cannot be built or loaded."""
    try:
        return load_library(source, default_cache_dir(), default_compiler())
    except LibraryBuildError as error:
        logger.warning("%s is unavailable, using %s: %s", what, fallback, error)
        return None


def load_function_or_warn(source: Path, name: str, argtypes: list, logger: logging.Logger, what: str,
                          fallback: str) -> Callable[..., int] | None:
    """The C function `name` of load_or_warn's library, its argument types set and an int status returned; None
    when the library is unavailable (after load_or_warn's warning)."""
    library = load_or_warn(source, logger, what, fallback)
    if library is None:
        return None
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def build_key(source: Path, compiler: list[str]) -> str:
    """16 hex digits of a hash over the source and the headers next to it (which it may include), the compiler's
    version, the flags and the CPU."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    for part in (_compiler_version(compiler), " ".join(COMPILE_FLAGS), platform.machine(), _cpu_identity()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _compiler_version(compiler: list[str]) -> str:
    output = _run([*compiler, "--version"], VERSION_TIMEOUT_S)
    return output.splitlines()[0] if output else ""


def _cpu_identity() -> str:
    """The first CPU's model name and feature flags from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "features", "cpu model", "isa")  # x86, ARM, MIPS and RISC-V spellings
    return "\n".join(line for line in first_cpu.splitlines() if line.split(":")[0].strip().lower() in wanted)


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


def _build(source: Path, library: Path, compiler: list[str]) -> None:
    try:
        handle, partial = tempfile.mkstemp(dir=library.parent, prefix=f".{library.stem}-", suffix=".so.partial")
        os.close(handle)
    except OSError as error:
        raise LibraryBuildError(f"cannot write to the cache directory {library.parent}: {error}") from error
    try:
        _run([*compiler, *COMPILE_FLAGS, "-o", partial, str(source)], COMPILE_TIMEOUT_S)
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
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LibraryBuildError(f"`{shlex.join(command)}` could not run: {error}") from error
    if done.returncode != 0:
        raise LibraryBuildError(f"`{shlex.join(command)}` exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout
