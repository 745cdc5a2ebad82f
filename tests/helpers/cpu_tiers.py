"""The CPU tiers this machine can execute, and copies of the checkout, for tests over every build of a kernel.

On an AVX-512 BF16 machine KERNEL_TIERS is every x86 build (x86-64, avx2,
avx512, avx512_bf16), so each kernel's variants are all checked against
their torch twins here; on an AVX2 machine, the two below.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.cpu_tier import CpuTier, kernel_builds, machine_flags, runnable_tiers

REPO = Path(__file__).resolve().parents[2]
KERNEL_TIERS = tuple(tier for tier in kernel_builds(platform.machine())
                     if tier in runnable_tiers(platform.machine(), machine_flags()))


def kernel_tier_params() -> list:
    """pytest params over KERNEL_TIERS, named by tier."""
    return [pytest.param(tier, id=tier.name) for tier in KERNEL_TIERS]


def tier_below(tier: CpuTier) -> CpuTier | None:
    """The next lower kernel build this machine runs, if any."""
    lower = KERNEL_TIERS[:KERNEL_TIERS.index(tier)]
    return lower[-1] if lower else None


def copy_checkout(destination: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to destination: a source checkout
    in which no kernel was built."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    return destination
