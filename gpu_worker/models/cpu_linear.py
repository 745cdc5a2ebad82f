"""Float32 linear layers on the CPU by a C kernel (cpu_linear.c) that streams each weight once per step.

Owns loading that kernel and the layer that calls it, TiledLinear. Knows
nothing of which layer is which: packed_linear.py decides where it is used.

Why: at the few rows of a decode step a linear layer is bound by reading
its weight, and oneDNN's packed kernels alternate reading with computing, so
at 16 rows they reach neither the memory's rate nor the arithmetic's. The
kernel prefetches the next column tile while it computes on the current one:
measured with tools/bench/kernels/bench_linear.py on a 2-core AMD EPYC, 1.3-1.6x
oneDNN's packed float32 at 1-16 rows on AVX2 and AVX-512, and within noise
of it (0.9-1.2x) at prefill sizes up to 2,048 rows, so one layout serves both
and the weights are held once. Below AVX2 (the x86-64 build, four-float SSE
registers) the register tile does not fit, so those tiers keep oneDNN.

Rows need no padding: the kernel compiles nothing per row count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.native.compiled_library import load_or_warn
from gpu_worker.native.profiled_range import kernel_range
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

SOURCE = Path(__file__).with_name("cpu_linear.c")
MIN_VECTOR_BITS = 256  # AVX2's registers: below them the register tile spills
STATUS_MESSAGES = {1: "sizes or strides outside the kernel's limits"}

_i64, _pointer = ctypes.c_int64, ctypes.c_void_p
# x, x_stride, packed, bias, out, out_stride, num_rows, in_features, out_features, num_threads
_LINEAR_ARGTYPES = [_pointer, _i64, _pointer, _pointer, _pointer, _i64, _i64, _i64, _i64, ctypes.c_int]


class TiledLinearKernel:
    """The loaded kernel: its column tile width and its float32 product."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.pagedserve_linear_tile_columns.restype = ctypes.c_int
        self.tile_columns: int = library.pagedserve_linear_tile_columns()
        self._linear = library.pagedserve_linear_f32
        self._linear.argtypes, self._linear.restype = _LINEAR_ARGTYPES, ctypes.c_int

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> [tiles, in, tile_columns]: column tiles, each [in][tile_columns], zero past `out`."""
        out_features, in_features = weight.shape
        num_tiles = -(-out_features // self.tile_columns)
        padded = F.pad(weight.detach(), (0, 0, 0, num_tiles * self.tile_columns - out_features))
        return padded.view(num_tiles, self.tile_columns, in_features).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """x [rows, in] (each row contiguous) -> a new [rows, out_features]."""
        num_rows, in_features = x.shape
        out = torch.empty((num_rows, out_features), dtype=torch.float32)
        with kernel_range("pagedserve::linear"):
            status = self._linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, num_rows,
                                  in_features, out_features, torch.get_num_threads())
        if status:
            raise ValueError(f"linear: the kernel refused its inputs after they were checked, for "
                             f"{STATUS_MESSAGES.get(status, f'status {status}')}")
        return out


class TiledLinear(nn.Module):
    """y = x @ W.T + b in float32, W held in the kernel's column tiles; built from an nn.Linear's weight and bias."""

    def __init__(self, kernel: TiledLinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed_weight = kernel.pack(weight)  # [tiles, in_features, tile_columns]
        padding = self.packed_weight.shape[0] * kernel.tile_columns - self.out_features
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padding))  # [tiles * tile_columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] float32 -> [..., out_features]."""
        if x.dtype != torch.float32:
            raise TypeError(f"TiledLinear computes in float32, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1 or rows.stride(0) < self.in_features:
            rows = rows.contiguous()
        y = self.kernel.linear(rows, self.packed_weight, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def load_tiled_linear_kernel(tier: CpuTier) -> TiledLinearKernel | None:
    """The kernel's build for the tier; None below AVX2 or (after one warning) if no build loads."""
    if tier.vector_bits < MIN_VECTOR_BITS:
        return None
    library = load_or_warn(SOURCE, logger, "the CPU linear kernel", "oneDNN's packed linear", tier)
    return None if library is None else TiledLinearKernel(library)
