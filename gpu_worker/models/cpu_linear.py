"""Linear layers on the CPU by a C kernel (cpu_linear.c) that streams each weight once per step, float32 or quantized.

Owns loading that kernel, laying weights out in its column tiles, and the
float32 layer that calls it, TiledLinear (quantized_linear.py holds the
quantized one). Knows nothing of which layer is which: packed_linear.py and
quantized_linear.py decide where it is used.

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
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.native.compiled_library import load_or_warn
from gpu_worker.native.profiled_range import call_named, profiling
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

SOURCE = Path(__file__).with_name("cpu_linear.c")
MIN_VECTOR_BITS = 256  # AVX2's registers: below them the register tile spills
STATUS_MESSAGES = {1: "sizes or strides outside the kernel's limits", 2: "an unknown weight format",
                   3: "no memory for a widened tile or the argmax's running bests"}
# The C side's WEIGHTS_FLOAT32, WEIGHTS_INT8 (a scale per column), WEIGHTS_INT4, WEIGHTS_INT8_GROUPED (per group),
# WEIGHTS_INT4_ZERO (int4 with zero points).
WEIGHT_FORMATS = {"float32": 0, "int8": 1, "int4": 2, "int8_grouped": 3, "int4_zero": 4}

_i64, _pointer, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# x, x_stride, format, packed, scales, group_size, bias, out, out_stride, num_rows, in_features, out_features, threads
_LINEAR_ARGTYPES = [_pointer, _i64, _int, _pointer, _pointer, _i64, _pointer, _pointer, _i64, _i64, _i64, _i64, _int]
_LINEAR_ARGMAX_ARGTYPES = [*_LINEAR_ARGTYPES[:-1], _pointer, _int]  # ..., out_features, tokens, threads
# x, x_stride, packed, bias, out, out_stride, num_rows, in_features, half, silu, threads
_LINEAR_PAIRS_ARGTYPES = [_pointer, _i64, _pointer, _pointer, _pointer, _i64, _i64, _i64, _i64, _int, _int]


def kernel_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in_features] as the [rows, in_features] a linear kernel reads: each row contiguous, rows apart by at
    least in_features (a view where x already is, else a copy)."""
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1 or rows.stride(0) < in_features:
        rows = rows.contiguous()
    return rows


class TiledLinearKernel:
    """The loaded kernel: its column tile width, the layouts it reads, and its product."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.pagedserve_linear_tile_columns.restype = ctypes.c_int
        self.tile_columns: int = library.pagedserve_linear_tile_columns()
        self._linear = library.pagedserve_linear
        self._linear.argtypes, self._linear.restype = _LINEAR_ARGTYPES, ctypes.c_int
        self._linear_argmax = library.pagedserve_linear_argmax
        self._linear_argmax.argtypes, self._linear_argmax.restype = _LINEAR_ARGMAX_ARGTYPES, ctypes.c_int
        self._linear_pairs = library.pagedserve_linear_pairs
        self._linear_pairs.argtypes, self._linear_pairs.restype = _LINEAR_PAIRS_ARGTYPES, ctypes.c_int

    def tiles(self, weight: torch.Tensor, padding_value: float = 0) -> torch.Tensor:
        """weight [out, ...] -> [tiles, tile_columns, ...]: `out` padded with padding_value to whole tiles."""
        num_tiles = -(-weight.shape[0] // self.tile_columns)
        pad = [0, 0] * (weight.dim() - 1) + [0, num_tiles * self.tile_columns - weight.shape[0]]
        padded = F.pad(weight.detach(), pad, value=padding_value)
        return padded.view(num_tiles, self.tile_columns, *weight.shape[1:])

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> [tiles, in, tile_columns]: column tiles, each [in][tile_columns], zero past `out`."""
        return self.tiles(weight).transpose(1, 2).contiguous()

    def in_pairs(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [2 * half, ...] (a gate's then an up's, or their biases) -> [tiles * tile_columns, ...] in the
        paired tiles' order: each half padded with zeros to whole vectors, then a vector's worth of gate rows,
        the same of up, the next of gate, ... (pagedserve_linear_pairs' layout)."""
        lanes = self.tile_columns // 2
        gate, up = rows.detach().chunk(2)
        padding = -(-gate.shape[0] // lanes) * lanes - gate.shape[0]
        halves = [F.pad(half, [0, 0] * (rows.dim() - 1) + [0, padding]).view(-1, lanes, *rows.shape[1:])
                  for half in (gate, up)]  # each [vectors, lanes, ...]
        return torch.stack(halves, dim=1).reshape(-1, *rows.shape[1:])

    def pack_int8(self, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] int8, scales [out] (per column) or [out, groups] -> (packed [tiles, in, tile_columns] int8,
        scales [tiles * tile_columns] or [tiles, groups, tile_columns])."""
        if scales.dim() == 2:
            return self.pack(q), self.tiles(scales.float()).transpose(1, 2).contiguous()
        return self.pack(q), self.tiles(scales.float()).reshape(-1).contiguous()

    def pack_int4(self, q: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [out, in] int8 holding values in [-8, 7], scales [out, groups] (and zero points, the same shape, in
        q's range) -> (packed [tiles, in, tile_columns / 2] uint8: byte j of a row holds column j in its low four
        bits and column tile_columns / 2 + j in its high four, each as q + 8; scales [tiles, groups, tile_columns],
        or with zero points [tiles, groups, 2, tile_columns]: each group's scales, then its zero points as
        float32 zero + 8, so that a weight is ((q + 8) - (zero + 8)) x scale)."""
        nibbles = self.tiles(q.to(torch.int16) + 8, padding_value=8).transpose(1, 2)  # [tiles, in, tile_columns]
        half = self.tile_columns // 2
        packed = (nibbles[..., :half] | (nibbles[..., half:] << 4)).to(torch.uint8).contiguous()
        tiled_scales = self.tiles(scales.float()).transpose(1, 2)
        if zeros is None:
            return packed, tiled_scales.contiguous()
        tiled_zeros = self.tiles(zeros.float() + 8, padding_value=8).transpose(1, 2)
        return packed, torch.stack([tiled_scales, tiled_zeros], dim=2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               weight_format: str = "float32", scales: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
        """x [rows, in] float32 (each row contiguous) -> a new [rows, out_features] float32."""
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        args = self.call_args(x, packed, bias, out, weight_format, scales, group_size)
        _check(call_named("pagedserve::linear", self._linear, args) if profiling() else self._linear(*args))
        return out

    def pairs_call(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                   silu: bool) -> tuple[Callable[..., int], tuple]:
        """The paired gate and up product of x [rows, in] into out: [rows, 2 * half] as the unpaired product
        lays it out, or with silu [rows, half] of silu(gate) * up; as (kernel, arguments), like call."""
        half = out.shape[1] if silu else out.shape[1] // 2
        return self._linear_pairs, (x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], half, int(silu),
                                    torch.get_num_threads())

    def linear_argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """linear with float32 weights, and each row's argmax of the result as the kernel wrote it (torch.argmax's:
        the lowest column on ties, NaN above everything): ([rows, out_features] float32, [rows] int64)."""
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        *args, threads = self.call_args(x, packed, bias, out)
        args = (*args, tokens.data_ptr(), threads)
        _check(call_named("pagedserve::linear", self._linear_argmax, args) if profiling()
               else self._linear_argmax(*args))
        return out, tokens

    def call(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
             weight_format: str = "float32", scales: torch.Tensor | None = None,
             group_size: int = 0) -> tuple[Callable[..., int], tuple]:
        """linear's product of x [rows, in] into out [rows, out_features] (each row contiguous) as (kernel,
        arguments), to be run later, as many times as needed, while every tensor named stays alive and in place;
        the kernel returns linear's status."""
        return self._linear, self.call_args(x, packed, bias, out, weight_format, scales, group_size)

    def call_args(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  weight_format: str = "float32", scales: torch.Tensor | None = None, group_size: int = 0) -> tuple:
        (num_rows, in_features), out_features = x.shape, out.shape[1]
        return (x.data_ptr(), x.stride(0), WEIGHT_FORMATS[weight_format], packed.data_ptr(),
                None if scales is None else scales.data_ptr(), group_size, None if bias is None else bias.data_ptr(),
                out.data_ptr(), out.stride(0), num_rows, in_features, out_features, torch.get_num_threads())


def _check(status: int) -> None:
    if status:
        raise ValueError(f"linear: the kernel refused its inputs after they were checked, for "
                         f"{STATUS_MESSAGES.get(status, f'status {status}')}")


class TiledLinear(nn.Module):
    """y = x @ W.T + b in float32, W held in the kernel's column tiles; built from an nn.Linear's weight and bias.

    paired_halves: W is a gated MLP's gate and up projection (its first half of rows the gate's, its second the
    up's), packed in pairs so that SiLU·up can be taken as the tiles are computed (silu_and_mul_call); forward's
    product is the same either way."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, kernel: TiledLinearKernel, weight: torch.Tensor, bias: torch.Tensor | None,
                 paired_halves: bool = False) -> None:
        super().__init__()
        if paired_halves and weight.shape[0] % 2:
            raise ValueError(f"a paired gate and up projection has an even number of rows, got {weight.shape[0]}")
        self.kernel = kernel
        self.paired_halves = paired_halves
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        packed = kernel.pack(kernel.in_pairs(weight) if paired_halves else weight)  # [tiles, in_features, tile_columns]
        self.register_buffer("packed_weight", packed, persistent=False)  # a buffer: the memory report counts it
        if bias is not None:
            bias = kernel.in_pairs(bias.float()) if paired_halves else bias.detach().float()
            bias = F.pad(bias, (0, packed.shape[0] * kernel.tile_columns - bias.shape[0]))
        self.register_buffer("bias", bias, persistent=False)  # [tiles * tile_columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] float32 -> [..., out_features]."""
        if x.dtype != torch.float32:
            raise TypeError(f"TiledLinear computes in float32, got {x.dtype}")
        rows = kernel_rows(x, self.in_features)
        if self.paired_halves:
            y = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
            kernel, args = self.kernel.pairs_call(rows, self.packed_weight, self.bias, y, silu=False)
            _check(call_named("pagedserve::linear", kernel, args) if profiling() else kernel(*args))
        else:
            y = self.kernel.linear(rows, self.packed_weight, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, in_features] float32 -> (forward's [rows, out_features], each row's argmax of it [rows] int64),
        the argmax taken as the kernel writes the rows: an LM head's greedy choice."""
        if x.dtype != torch.float32 or x.dim() != 2:
            raise TypeError(f"TiledLinear takes float32 rows, got {x.dtype} of {x.dim()} dimensions")
        if self.paired_halves:
            raise ValueError("a paired gate and up projection has no argmax: its columns are no vocabulary")
        return self.kernel.linear_argmax(kernel_rows(x, self.in_features), self.packed_weight, self.bias,
                                         self.out_features)

    def kernel_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """forward's product of x [rows, in_features] float32 into out [rows, out_features] as a kernel call
        (TiledLinearKernel.call)."""
        if self.paired_halves:
            return self.kernel.pairs_call(x, self.packed_weight, self.bias, out, silu=False)
        return self.kernel.call(x, self.packed_weight, self.bias, out)

    def silu_and_mul_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """A paired gate and up projection's silu(gate) * up of x [rows, in_features] float32 into out [rows,
        out_features / 2], as a kernel call: the product and the MLP's activation in one pass."""
        if not self.paired_halves:
            raise ValueError("SiLU·up is taken in the product of a paired gate and up projection only")
        return self.kernel.pairs_call(x, self.packed_weight, self.bias, out, silu=True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def load_tiled_linear_kernel(tier: CpuTier) -> TiledLinearKernel | None:
    """The kernel's build for the tier; None below AVX2 or (after one warning) if no build loads."""
    if tier.vector_bits < MIN_VECTOR_BITS:
        return None
    library = load_or_warn(SOURCE, logger, "the CPU linear kernel", "oneDNN's packed linear", tier)
    return None if library is None else TiledLinearKernel(library)
