"""The per-row layer ops on the CPU by C kernels (cpu_fused.c), one pass over the rows each.

Owns loading the kernels and handing them a layer's rows. Knows nothing of
the model around them; has the contract of layers.py's torch ops (a
LayerOps), which stay the reference these are tested against and the
fallback: when the library cannot be built the CPU runs layers.py's ops
alone, and inputs the kernels do not take (float16, another device, a last
dim that is not contiguous, rows that overlap) go there too, call by call.
Unlike the torch ops these work in place where the model lets them:
add_rms_norm leaves the sum in residual and writes the normed rows over x,
apply_rotary turns q and k inside the qkv buffer.

How it works: the library is compiled on first use (compiled_library.py),
loaded with ctypes and called with the tensors' data pointers, row strides
and sizes. A batch of fewer than PARALLEL_MIN_ELEMENTS values runs on the
calling thread alone, a larger one on torch's OpenMP threads, its rows split
between them (tools/bench/kernels/bench_fused_ops.py measures both sides).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.attention.torch_paged import write_kv_cache
from gpu_worker.models import layers
from gpu_worker.models.kernel_program import KernelCall
from gpu_worker.models.layers import LayerOps
from gpu_worker.native.compiled_library import load_or_warn
from gpu_worker.native.profiled_range import call_named, profiling
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

SOURCE = Path(__file__).with_name("cpu_fused.c")
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's DTYPE_FLOAT32, DTYPE_BFLOAT16
WRITE_KV_CACHES = slice(5, 7)  # where the k and v caches' pointers are in write_kv_call's arguments
STATUS_MESSAGES = {1: "sizes or strides outside the kernel's limits", 2: "an unknown dtype",
                   3: "a slot outside the KV cache"}
# On 2 cores, at their best a second thread gains nothing on 16 rows of 576 (x1.06-1.16), x1.3-1.5 on 64
# and x1.7-1.9 from 256 rows on (SiLU * up, dearer per value, from fewer); but on cores other work shares,
# a split batch waits for its slowest thread, and the median turns 3-100x slower. So only batches well
# past decode sizes are split: 65536 values are 114 rows of 576, 43 of SiLU's 1536, 86 of 12 heads of 64.
PARALLEL_MIN_ELEMENTS = 1 << 16

_i64, _pointer, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    # dtype, x, x_stride, weight, out, out_stride, num_rows, hidden, eps, num_threads
    "pagedserve_rms_norm": [_int, _pointer, _i64, _pointer, _pointer, _i64, _i64, _i64, ctypes.c_float, _int],
    # dtype, x, x_stride, residual, residual_stride, weight, num_rows, hidden, eps, num_threads
    "pagedserve_add_rms_norm": [_int, _pointer, _i64, _pointer, _i64, _pointer, _i64, _i64, ctypes.c_float, _int],
    # dtype, gate_up, gate_up_stride, out, out_stride, num_rows, intermediate_size, num_threads
    "pagedserve_silu_and_mul": [_int, _pointer, _i64, _pointer, _i64, _i64, _i64, _int],
    # dtype, qk, qk_stride, num_heads, cos, sin, cos_sin_stride, num_rows, head_dim, num_threads
    "pagedserve_apply_rotary": [_int, _pointer, _i64, _i64, _pointer, _pointer, _i64, _i64, _i64, _int],
    # dtype, k, k_stride, v, v_stride, k_cache, v_cache, slots, num_rows, row_size, num_slots
    "pagedserve_write_kv": [_int, _pointer, _i64, _pointer, _i64, _pointer, _pointer, _pointer, _i64, _i64, _i64],
}


class CpuFusedKernels:
    """The loaded library; each method is a drop-in for the layers.py function of its name.

    parallel_min_elements: the size of a batch from which on a call runs on torch's threads.
    """

    def __init__(self, library: ctypes.CDLL, parallel_min_elements: int = PARALLEL_MIN_ELEMENTS) -> None:
        self.parallel_min_elements = parallel_min_elements
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        self._rms_norm, self._add_rms_norm = library.pagedserve_rms_norm, library.pagedserve_add_rms_norm
        self._silu_and_mul, self._apply_rotary = library.pagedserve_silu_and_mul, library.pagedserve_apply_rotary
        self._write_kv = library.pagedserve_write_kv

    def layer_ops(self) -> LayerOps:
        return LayerOps(rms_norm=self.rms_norm, add_rms_norm=self.add_rms_norm, silu_and_mul=self.silu_and_mul,
                        apply_rotary=self.apply_rotary)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> a new tensor of its normed rows."""
        if not (_takes_rows(x) and _is_vector_of(weight, x)):
            return layers.rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)  # [num_tokens, hidden_size]
        _run("rms_norm", *self.rms_norm_call(x, weight, eps, out))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [num_tokens, hidden_size] -> (x overwritten with the normed sum, residual holding the sum)."""
        if not (_takes_rows(x) and _takes_rows(residual) and residual.shape == x.shape and residual.dtype == x.dtype
                and _is_vector_of(weight, x)):
            return layers.add_rms_norm(x, residual, weight, eps)
        _run("add_rms_norm", *self.add_rms_norm_call(x, residual, weight, eps))
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [num_tokens, 2 * intermediate_size] -> a new [num_tokens, intermediate_size] of silu(gate) * up."""
        if not _takes_rows(gate_up) or gate_up.shape[1] % 2:
            return layers.silu_and_mul(gate_up)
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)  # [num_tokens, intermediate]
        _run("silu_and_mul", *self.silu_and_mul_call(gate_up, out))
        return out

    def silu_and_mul_float32(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu_and_mul on float32 rows, torch's op on any other dtype (where the tier's kernel is slower)."""
        if gate_up.dtype != torch.float32:
            return layers.silu_and_mul(gate_up)
        return self.silu_and_mul(gate_up)

    def apply_rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate qk [num_tokens, num_heads, head_dim] in place by cos, sin [num_tokens, head_dim]; returns qk."""
        if not _takes_heads(qk, cos, sin):
            return layers.apply_rotary(qk, cos, sin)
        _run("apply_rotary", *self.apply_rotary_call(qk, cos, sin))
        return qk

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """torch_paged.write_kv_cache: each new token's k and v [num_tokens, num_kv_heads, head_dim] stored at its
        flat cache slot (slot_mapping [num_tokens] int64)."""
        if not takes_kv(k, v, k_cache, v_cache, slot_mapping):
            write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
            return
        _run("write_kv", *self.write_kv_call(k, v, k_cache, v_cache, slot_mapping))

    # The calls the methods above make, as (kernel, arguments) to be run later, as many times as needed, while
    # every tensor named stays alive and in place; each kernel returns a status (STATUS_MESSAGES). The
    # inputs are the methods' own, as the methods check them.

    def rms_norm_call(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> KernelCall:
        num_rows, hidden = x.shape
        return self._rms_norm, (KERNEL_DTYPES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                                out.stride(0), num_rows, hidden, eps, self._num_threads(x.numel()))

    def add_rms_norm_call(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> KernelCall:
        num_rows, hidden = x.shape
        return self._add_rms_norm, (KERNEL_DTYPES[x.dtype], x.data_ptr(), x.stride(0), residual.data_ptr(),
                                    residual.stride(0), weight.data_ptr(), num_rows, hidden, eps,
                                    self._num_threads(x.numel()))

    def silu_and_mul_call(self, gate_up: torch.Tensor, out: torch.Tensor) -> KernelCall:
        num_rows, size = gate_up.shape[0], gate_up.shape[1] // 2
        return self._silu_and_mul, (KERNEL_DTYPES[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0),
                                    out.data_ptr(), out.stride(0), num_rows, size,
                                    self._num_threads(gate_up.numel()))

    def apply_rotary_call(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KernelCall:
        num_rows, num_heads, head_dim = qk.shape
        return self._apply_rotary, (KERNEL_DTYPES[qk.dtype], qk.data_ptr(), qk.stride(0), num_heads, cos.data_ptr(),
                                    sin.data_ptr(), cos.stride(0), num_rows, head_dim, self._num_threads(qk.numel()))

    def write_kv_call(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> KernelCall:
        row_size = k.shape[1] * k.shape[2]
        return self._write_kv, (KERNEL_DTYPES[k.dtype], k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], row_size,
                                k_cache.numel() // row_size)

    def _num_threads(self, num_elements: int) -> int:
        return torch.get_num_threads() if num_elements >= self.parallel_min_elements else 1


def _takes_rows(x: torch.Tensor) -> bool:
    """Whether x is rows the kernels read: [num_rows, width] on the CPU, a kernel dtype, each row contiguous, apart."""
    return (x.dtype in KERNEL_DTYPES and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and x.stride(0) >= x.shape[1] > 0)


def _is_vector_of(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return weight.dtype == x.dtype and weight.is_cpu and weight.shape == x.shape[1:] and weight.stride(0) == 1


def _takes_heads(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether qk [num_tokens, num_heads, head_dim] has adjacent heads and cos, sin [num_tokens, head_dim] match it."""
    if qk.dim() != 3 or not (_takes_rows(cos) and cos.dtype == sin.dtype == qk.dtype and qk.is_cpu and sin.is_cpu):
        return False
    num_rows, num_heads, head_dim = qk.shape
    return (head_dim % 2 == 0 and qk.stride(2) == 1 and qk.stride(1) == head_dim
            and qk.stride(0) >= num_heads * head_dim and cos.shape == sin.shape == (num_rows, head_dim)
            and sin.stride() == cos.stride())


def takes_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> bool:
    """Whether k, v [num_tokens, num_kv_heads, head_dim] have each row's heads adjacent, the caches are whole
    contiguous CPU tensors of their dtype and heads, and the slots an int64 vector with one per token."""
    if not (k.dim() == v.dim() == 3 and k.shape == v.shape and k.dtype == v.dtype in KERNEL_DTYPES):
        return False
    num_tokens, num_kv_heads, head_dim = k.shape
    return (all(t.is_cpu and t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v))
            and all(c.is_cpu and c.is_contiguous() and c.dtype == k.dtype and c.shape[-2:] == (num_kv_heads, head_dim)
                    for c in (k_cache, v_cache)) and k_cache.shape == v_cache.shape
            and slot_mapping.is_cpu and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.shape == (num_tokens,))


def _run(op: str, function: Callable[..., int], args: tuple) -> None:
    """function(*args), named pagedserve::<op> in a running profile; a non-zero status is a ValueError."""
    status = call_named(f"pagedserve::{op}", function, args) if profiling() else function(*args)
    if status:
        raise ValueError(f"{op}: the kernel refused its inputs after they were checked, for "
                         f"{STATUS_MESSAGES.get(status, f'status {status}')}")


@functools.cache
def load_cpu_fused_kernels(tier: CpuTier | None = None) -> CpuFusedKernels | None:
    """The kernels' build for the tier (this process's by default); None (after one warning) if none loads."""
    library = load_or_warn(SOURCE, logger, "the CPU layer kernels", "the torch ops", tier)
    return None if library is None else CpuFusedKernels(library)
