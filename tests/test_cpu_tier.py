"""The CPU tier: read from /proc/cpuinfo's flags, overridable by $PAGEDSERVE_CPU_ISA, holding torch and oneDNN to
it; and the dtype a model computes in on each tier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpu_worker.models.dtype_policy import compute_dtype
from shared.cpu_tier import (
    OVERRIDE_VARIABLE,
    TIERS,
    CpuTierError,
    best_tier,
    choose_tier,
    cpu_flags,
    kernel_builds,
    limit_libraries,
    machine_flags,
    tier_named,
)

from helpers.cpu_tiers import REPO

# Flags as /proc/cpuinfo lists them on the machines seen: an AVX2-only EPYC (Zen 3), an AVX-512 BF16 EPYC (Zen 4),
# a Xeon with AMX (Sapphire Rapids), a Graviton 3; trimmed to the flags that matter plus a few that do not.
ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma bmi2 sha_ni"
ZEN4 = f"{ZEN3} avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi"
SAPPHIRE_RAPIDS = f"{ZEN4} amx_bf16 amx_tile amx_int8 avx_vnni"
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve"


@pytest.mark.parametrize("machine, flags, expected", [
    ("x86_64", "fpu sse sse2", "x86-64"),
    ("x86_64", ZEN3, "avx2"),
    ("x86_64", ZEN3.replace(" fma", ""), "x86-64"),  # AVX2 without FMA is not the avx2 tier
    ("x86_64", f"{ZEN3} avx512f avx512dq avx512cd avx512bw avx512vl", "avx512"),
    ("x86_64", ZEN4, "avx512_bf16"),
    ("x86_64", SAPPHIRE_RAPIDS, "amx"),
    ("aarch64", GRAVITON3, "aarch64_bf16"),
    ("aarch64", "fp asimd", "aarch64"),
    ("riscv64", "", "portable"),
])
def test_the_best_tier_is_read_from_the_flags(machine, flags, expected):
    assert best_tier(machine, cpu_flags(f"processor\t: 0\nflags\t\t: {flags}\n")).name == expected
    assert best_tier(machine, cpu_flags(f"processor\t: 0\nFeatures\t: {flags}\n")).name == expected


def test_only_avx512_bf16_and_up_compute_bfloat16_natively():
    native = {tier.name for tier in TIERS if tier.has_native_bf16}
    assert native == {"avx512_bf16", "amx", "aarch64_bf16"}
    assert not tier_named("avx2").can_pack_bf16 and tier_named("avx512").can_pack_bf16


def test_amx_runs_the_avx512_bf16_kernels_and_each_x86_build_is_its_own():
    assert tier_named("amx").kernel_build == "avx512_bf16"
    assert [tier.name for tier in kernel_builds("x86_64")] == ["x86-64", "avx2", "avx512", "avx512_bf16"]


def test_the_override_chooses_a_lower_tier_and_refuses_a_higher_or_unknown_one():
    zen3 = cpu_flags(f"flags : {ZEN3}")
    assert choose_tier("x86_64", zen3, None).name == "avx2"
    assert choose_tier("x86_64", zen3, " X86-64 ").name == "x86-64"
    with pytest.raises(CpuTierError, match="asks for a tier this CPU cannot run: its best is avx2; choose one of "
                                           "x86-64, avx2"):
        choose_tier("x86_64", zen3, "avx512")
    with pytest.raises(CpuTierError, match="no CPU tier is named 'sse9'; expected one of x86-64, avx2, avx512"):
        choose_tier("x86_64", zen3, "sse9")


def test_the_override_sets_torch_and_onednn_limits_unless_already_set():
    environ = {OVERRIDE_VARIABLE: "x86-64", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert limit_libraries(environ).name == "x86-64"
    assert environ == {OVERRIDE_VARIABLE: "x86-64", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    environ = {}
    assert limit_libraries(environ) is None and environ == {}


def test_under_the_override_torch_runs_that_tiers_code():
    """torch reads ATEN_CPU_CAPABILITY when it is imported: the worker package sets it first."""
    if "avx2" not in machine_flags():
        pytest.skip("needs a CPU with AVX2 to hold it to AVX2")
    env = {key: value for key, value in os.environ.items() if key not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    script = "import gpu_worker, torch; print(torch.backends.cpu.get_cpu_capability())"
    for override, expected in (("avx2", "AVX2"), ("x86-64", "DEFAULT")):
        run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, OVERRIDE_VARIABLE: override},
                             capture_output=True, text=True, timeout=120, check=True)
        assert run.stdout.strip() == expected


CPU = torch.device("cpu")


@pytest.mark.parametrize("tier, checkpoint, expected", [
    ("avx512_bf16", torch.bfloat16, torch.bfloat16),
    ("amx", torch.float16, torch.bfloat16),
    ("avx512", torch.bfloat16, torch.float32),
    ("avx2", torch.bfloat16, torch.float32),
    ("x86-64", torch.float16, torch.float32),
    ("avx2", torch.float32, torch.float32),
])
def test_auto_computes_in_bfloat16_only_where_the_cpu_does_natively(tier, checkpoint, expected):
    choice = compute_dtype("auto", checkpoint, CPU, tier_named(tier))
    assert choice.dtype == expected and not choice.emulated
    assert str(expected).removeprefix("torch.") in choice.why


def test_an_explicit_bfloat16_is_obeyed_and_flagged_where_it_is_emulated():
    emulated = compute_dtype(torch.bfloat16, torch.float32, CPU, tier_named("avx2"))
    assert emulated.dtype == torch.bfloat16 and emulated.emulated and "emulated" in emulated.why
    native = compute_dtype(torch.bfloat16, torch.float32, CPU, tier_named("avx512_bf16"))
    assert native.dtype == torch.bfloat16 and not native.emulated


def test_on_a_gpu_auto_is_the_checkpoints_dtype():
    assert compute_dtype("auto", torch.bfloat16, torch.device("cuda"), tier_named("x86-64")).dtype == torch.bfloat16


def test_the_server_refuses_an_override_it_cannot_run_at_start_up():
    env = {**os.environ, OVERRIDE_VARIABLE: "sse9"}
    run = subprocess.run([sys.executable, "-m", "server", "--port", "0"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "no CPU tier is named 'sse9'; expected one of x86-64, avx2" in run.stderr
