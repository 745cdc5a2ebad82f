"""Kernel calls run by one C call (gpu_worker/models/kernel_program.py) against the same calls made one by one."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.cpu_decode import SOURCE as DECODE_SOURCE
from gpu_worker.attention.cpu_decode import CpuDecodeKernel
from gpu_worker.attention.cpu_prefill import SOURCE as PREFILL_SOURCE
from gpu_worker.attention.cpu_prefill import CpuPrefillKernel
from gpu_worker.models import layers
from gpu_worker.models.cpu_fused import SOURCE as FUSED_SOURCE
from gpu_worker.models.cpu_fused import WRITE_KV_CACHES, CpuFusedKernels
from gpu_worker.models.cpu_linear import MIN_VECTOR_BITS, TiledLinear, TiledLinearKernel
from gpu_worker.models.cpu_linear import SOURCE as LINEAR_SOURCE
from gpu_worker.models.cpu_linear_bf16 import load_pair_linear_kernel
from gpu_worker.models.kernel_program import SOURCE, KernelProgram, KernelRefused, ProgramRunner
from gpu_worker.native.compiled_library import load_kernel_library

from helpers.cpu_tiers import kernel_tier_params

HIDDEN = 64


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request):
    return request.param


@pytest.fixture(scope="module")
def runner(tier) -> ProgramRunner:
    return ProgramRunner(load_kernel_library(SOURCE, tier))


@pytest.fixture(scope="module")
def fused(tier) -> CpuFusedKernels:
    return CpuFusedKernels(load_kernel_library(FUSED_SOURCE, tier))


def rows(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))  # [num_rows, HIDDEN]


def test_every_kernel_of_a_step_is_called_from_c_on_every_tier(runner, fused, tier):
    """The per-row kernels, decode and prefill attention and the linear kernels each have their prototype in
    kernel_program.c, so a step of them is one C call on every tier."""
    kernels = [fused._rms_norm, fused._add_rms_norm, fused._silu_and_mul, fused._apply_rotary, fused._write_kv,
               CpuDecodeKernel(load_kernel_library(DECODE_SOURCE, tier))._attend,
               CpuPrefillKernel(load_kernel_library(PREFILL_SOURCE, tier))._attend]
    if tier.vector_bits >= MIN_VECTOR_BITS:
        kernels.append(TiledLinearKernel(load_kernel_library(LINEAR_SOURCE, tier))._linear)
    if (pair := load_pair_linear_kernel(tier)) is not None:
        kernels.append(pair._linear)
    assert [runner.signature(kernel) is not None for kernel in kernels] == [True] * len(kernels)


def test_a_program_gives_what_its_calls_give_one_by_one(runner, fused):
    """Norms with a float eps that matters, in place on shared rows: the program's results equal the same calls
    made through ctypes one at a time, bit for bit, and the reference ops' within float32's rounding."""
    x, residual, weight = rows(5, 1), rows(5, 2), rows(1, 3)[0]
    eps = 0.75  # large enough that an eps read as anything else changes every value
    expected_x, expected_residual = x.clone(), residual.clone()
    one_by_one = [fused.add_rms_norm_call(expected_x, expected_residual, weight, eps),
                  fused.add_rms_norm_call(expected_x, expected_residual, weight, eps / 3)]
    for kernel, args in one_by_one:
        assert kernel(*args) == 0
    program = KernelProgram(runner, [("norm", fused.add_rms_norm_call(x, residual, weight, eps)),
                                     ("norm", fused.add_rms_norm_call(x, residual, weight, eps / 3))])
    assert program.segments == [(0, 2)]
    program.run()
    assert torch.equal(x, expected_x) and torch.equal(residual, expected_residual)
    reference, reference_residual = layers.add_rms_norm(rows(5, 1), rows(5, 2), weight, eps)
    reference, _ = layers.add_rms_norm(reference, reference_residual, weight, eps / 3)
    torch.testing.assert_close(x, reference, rtol=1e-5, atol=1e-5)


def test_python_calls_run_in_their_place_between_runs_of_c_calls(runner, fused):
    """A call the C side cannot make (a Python function) splits the program: it sees the rows as the C call
    before it left them, and the C call after it sees what it wrote."""
    x, weight, out = rows(3, 4), rows(1, 5)[0], torch.empty(3, HIDDEN)
    seen = []

    def double(t: torch.Tensor) -> int:
        seen.append(t.clone())
        t.mul_(2)
        return 0

    program = KernelProgram(runner, [("norm", fused.rms_norm_call(x, weight, 1e-5, out)), ("double", (double, (out,))),
                                     ("norm", fused.rms_norm_call(out, weight, 1e-5, x))])
    assert program.segments == [(0, 1), 1, (2, 3)]
    first = fused.rms_norm(rows(3, 4), weight, 1e-5)  # the same kernel, called on its own
    program.run()
    assert torch.equal(seen[0], first) and torch.equal(out, first * 2)
    assert torch.equal(x, fused.rms_norm(first * 2, weight, 1e-5))


def test_a_refused_call_stops_the_program_and_names_itself(runner, fused):
    """A KV write to a slot outside the cache returns its status: the program stops there, raises naming the op
    and its place, and the call after it never runs."""
    k = v = torch.ones(2, 1, HIDDEN)  # [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache = torch.zeros(4, 2, 1, HIDDEN), torch.zeros(4, 2, 1, HIDDEN)  # 8 slots
    x, weight, out = rows(2, 6), rows(1, 7)[0], torch.zeros(2, HIDDEN)
    program = KernelProgram(runner, [("write_kv", fused.write_kv_call(k, v, k_cache, v_cache, torch.tensor([0, 8]))),
                                     ("norm", fused.rms_norm_call(x, weight, 1e-5, out))])
    with pytest.raises(KernelRefused, match="write_kv: the kernel refused its inputs, status 3") as refused:
        program.run()
    assert (refused.value.index, refused.value.op) == (0, "write_kv")
    assert not out.any() and not k_cache.any()


def test_a_call_is_bound_again_in_place_and_only_to_its_own_kind(runner, fused):
    """bind puts a new call of the same signature at its place (the next run uses it); a call of another
    signature, or a Python call where the C side calls, is refused."""
    x, weight = rows(2, 8), rows(1, 9)[0]
    out, other_out = torch.zeros(2, HIDDEN), torch.zeros(2, HIDDEN)
    program = KernelProgram(runner, [("norm", fused.rms_norm_call(x, weight, 1e-5, out))])
    program.bind(0, fused.rms_norm_call(x, weight, 1e-5, other_out))
    program.run()
    assert not out.any() and torch.equal(other_out, fused.rms_norm(x, weight, 1e-5))
    with pytest.raises(ValueError, match="norm needs a kernel of the signature it was built with"):
        program.bind(0, fused.silu_and_mul_call(torch.zeros(2, 2 * HIDDEN), out))
    with pytest.raises(ValueError, match="norm is a C call in this program"):
        program.bind(0, (lambda: 0, ()))


def test_a_linear_kernel_in_a_program_gives_its_module_product(runner, tier):
    """The linear kernel's thirteen arguments (pointers, sizes, an int format and thread count) through a record:
    the same product as the module's forward."""
    if tier.vector_bits < MIN_VECTOR_BITS:
        pytest.skip("below AVX2 the float32 projections are oneDNN's, not the kernel's")
    kernel = TiledLinearKernel(load_kernel_library(LINEAR_SOURCE, tier))
    linear = TiledLinear(kernel, rows(48, 10), torch.randn(48))
    x, out = rows(7, 11), torch.empty(7, 48)
    program = KernelProgram(runner, [("proj", linear.kernel_call(x, out))])
    assert program.segments == [(0, 1)]
    program.run()
    assert torch.equal(out, linear(x))


def test_bind_each_puts_one_call_at_every_place_of_its_op_on_each_places_pointers(runner, fused):
    """Two layers' KV writes bound from the first layer's call: each place gets its own caches' pointers, and a run
    stores the rows in both layers' caches (and only there)."""
    k, v = torch.randn(2, 1, HIDDEN), torch.randn(2, 1, HIDDEN)  # [num_tokens, num_kv_heads, head_dim]
    caches = [(torch.zeros(4, 2, 1, HIDDEN), torch.zeros(4, 2, 1, HIDDEN)) for _ in range(2)]  # two layers' 8 slots
    slots, stale_slots = torch.tensor([3, 6]), torch.tensor([0, 1])
    program = KernelProgram(runner, [("write_kv", fused.write_kv_call(k, v, *caches[0], stale_slots)),
                                     ("write_kv", fused.write_kv_call(k, v, *caches[1], stale_slots))])
    pointers = [(k_cache.data_ptr(), v_cache.data_ptr()) for k_cache, v_cache in caches]
    program.bind_each("write_kv", fused.write_kv_call(k, v, *caches[0], slots), WRITE_KV_CACHES, pointers)
    program.run()
    for k_cache, v_cache in caches:
        assert torch.equal(k_cache.view(8, 1, HIDDEN)[slots], k) and torch.equal(v_cache.view(8, 1, HIDDEN)[slots], v)
        assert not k_cache.view(8, 1, HIDDEN)[stale_slots].any()
