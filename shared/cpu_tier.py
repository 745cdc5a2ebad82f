"""The CPU's instruction-set tier: read once from /proc/cpuinfo, named, and overridable with $PAGEDSERVE_CPU_ISA.

Owns the list of tiers (x86-64 baseline, AVX2+FMA, AVX-512, AVX-512 BF16/VNNI,
AMX; aarch64 with and without bf16), what each needs of the CPU, the compiler
flags its kernels are built with, whether it computes bfloat16 natively, and
the settings that hold torch and oneDNN to it. Must not import torch or any
part of the project: the frontend, the worker and the package's build
(setup.py) all read it.

Everything that chooses a path by the CPU asks current_tier(): the dtype
policy (bfloat16 only where it is native), linear packing, which build of
each C kernel is loaded and which kernels beat torch's ops on it (by the
width of its vector registers), the roofline. The override names a tier at or
below the CPU's, so that a machine with AVX-512 runs exactly what an AVX2
machine runs: the kernels of that tier, and torch's and oneDNN's code for it
(ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, which those libraries read
once, when torch is imported; limit_libraries() sets them).
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

OVERRIDE_VARIABLE = "PAGEDSERVE_CPU_ISA"
WIDE_VECTOR_BITS = 512
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class CpuTier:
    name: str
    machine: str  # platform.machine() of the CPUs it applies to
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have
    kernel_build: str  # the tier whose kernel binaries it runs (AMX adds nothing the kernels use)
    compile_flags: tuple[str, ...]  # gcc flags of its kernel build, when kernel_build is its own name
    has_native_bf16: bool  # bfloat16 matmuls run in hardware, not widened to float32 first
    can_pack_bf16: bool  # oneDNN takes bfloat16 weights in its blocked layout (torch checks for AVX-512 BW/VL/DQ)
    aten_capability: str | None  # ATEN_CPU_CAPABILITY that holds torch's kernels to this tier
    onednn_isa: str | None  # ONEDNN_MAX_CPU_ISA that holds oneDNN to this tier
    vector_bits: int  # the width of its vector registers

    @property
    def has_wide_vectors(self) -> bool:
        """Whether one register holds 16 floats. Narrower, the compiler leaves the fused SiLU·up loop scalar, and
        torch's op is faster (the attention kernels size their vectors to the build instead)."""
        return self.vector_bits >= WIDE_VECTOR_BITS

    def describe(self) -> str:
        native = "bfloat16 native" if self.has_native_bf16 else "no native bfloat16"
        return f"{self.name} ({native}; kernels built for {self.kernel_build})"


_X86_64 = "x86_64"
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_AVX512_BF16 = _AVX512 | {"avx512_bf16", "avx512_vnni"}
_AVX2_FLAGS = ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")

TIERS = (  # lowest first, per machine
    CpuTier("x86-64", _X86_64, frozenset(), "x86-64", ("-march=x86-64",), False, False, "default", "SSE41", 128),
    CpuTier("avx2", _X86_64, _AVX2, "avx2", _AVX2_FLAGS, False, False, "avx2", "AVX2", 256),
    CpuTier("avx512", _X86_64, _AVX512, "avx512", _AVX512_FLAGS, False, True, "avx512", "AVX512_CORE", 512),
    CpuTier("avx512_bf16", _X86_64, _AVX512_BF16, "avx512_bf16", (*_AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni"),
            True, True, "avx512", "AVX512_CORE_BF16", 512),
    CpuTier("amx", _X86_64, _AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}, "avx512_bf16", (), True, True,
            "avx512", "AVX512_CORE_AMX", 512),
    CpuTier("aarch64", "aarch64", frozenset(), "aarch64", ("-march=armv8-a",), False, False, None, None, 128),
    CpuTier("aarch64_bf16", "aarch64", frozenset({"bf16"}), "aarch64", (), True, True, None, None, 128),
)
PORTABLE = CpuTier("portable", "", frozenset(), "portable", (), False, False, None, None, 128)  # any other machine


class CpuTierError(ValueError):
    """$PAGEDSERVE_CPU_ISA names no tier, or one this CPU cannot run."""


def tiers_of(machine: str) -> tuple[CpuTier, ...]:
    """This machine's tiers, lowest first; (PORTABLE,) for a machine with none listed."""
    return tuple(tier for tier in TIERS if tier.machine == machine) or (PORTABLE,)


def kernel_builds(machine: str) -> tuple[CpuTier, ...]:
    """The tiers whose kernels are built for this machine (at install), lowest first."""
    return tuple(tier for tier in tiers_of(machine) if tier.kernel_build == tier.name)


def tier_named(name: str) -> CpuTier:
    for tier in (*TIERS, PORTABLE):
        if tier.name == name:
            return tier
    raise CpuTierError(f"no CPU tier is named {name!r}; expected one of {', '.join(t.name for t in TIERS)}")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first CPU's feature flags ("flags" on x86, "Features" on ARM) in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def best_tier(machine: str, flags: frozenset[str]) -> CpuTier:
    """The highest of this machine's tiers whose needs the flags meet."""
    runnable = [tier for tier in tiers_of(machine) if tier.needs <= flags]
    return runnable[-1]


def runnable_tiers(machine: str, flags: frozenset[str]) -> tuple[CpuTier, ...]:
    """Every tier this CPU can run, lowest first: the ones a test matrix covers."""
    return tuple(tier for tier in tiers_of(machine) if tier.needs <= flags)


def choose_tier(machine: str, flags: frozenset[str], override: str | None) -> CpuTier:
    """The CPU's best tier, or the override's when it names one this CPU can run (else CpuTierError)."""
    best = best_tier(machine, flags)
    if not override:
        return best
    wanted = tier_named(override.strip().lower())
    if wanted not in runnable_tiers(machine, flags):
        raise CpuTierError(f"${OVERRIDE_VARIABLE}={override} asks for a tier this CPU cannot run: its best is "
                           f"{best.name}; choose one of {', '.join(t.name for t in runnable_tiers(machine, flags))}")
    return wanted


@functools.cache
def machine_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_flags(CPUINFO.read_text())
    except OSError:
        return frozenset()


def current_tier() -> CpuTier:
    """This process's tier: the CPU's best, or $PAGEDSERVE_CPU_ISA's (CpuTierError when it cannot be run)."""
    return choose_tier(platform.machine(), machine_flags(), os.environ.get(OVERRIDE_VARIABLE))


def limit_libraries(environ: MutableMapping[str, str]) -> CpuTier | None:
    """Under $PAGEDSERVE_CPU_ISA, set torch's and oneDNN's own limits in `environ` (those not set already) to that
    tier; they take effect in a process that imports torch afterwards. The override's tier, or None."""
    override = environ.get(OVERRIDE_VARIABLE)
    if not override:
        return None
    tier = choose_tier(platform.machine(), machine_flags(), override)
    for variable, value in (("ATEN_CPU_CAPABILITY", tier.aten_capability), ("ONEDNN_MAX_CPU_ISA", tier.onednn_isa)):
        if value is not None:
            environ.setdefault(variable, value)
    return tier
