"""bfloat16 linear layers on CPUs with AVX-512 BF16, by a C kernel (cpu_linear_bf16.c) of pair products.

Owns loading that kernel, laying bfloat16 weights out in its pair tiles, and
the layer that calls it, PairTiledLinear. Knows nothing of which layer is
which: packed_linear.py decides where it is used.

Why: at the few rows of a decode step oneDNN's packed bfloat16 product
reaches about a third of the machine (34-35% at 12-16 rows on a 2-core AMD
EPYC Zen 4, tools/bench/kernels/bench_linear.py), so a bfloat16 model's
decode steps ran at under a third of their floor. This kernel's
`vdpbf16ps` does two products per float32 lane per instruction from weights
packed once for it, and prefetches the next column tile while it computes
on the current one, as the float32 kernel does (cpu_linear.c); one layout
serves decode and prefill rows, so the weights are held once. Where the CPU
has no AVX-512 BF16 the kernel's build is a stub that says so, and where it
has AMX, oneDNN's matrix tiles compute prefill rows 5x faster: on both,
bfloat16 weights stay oneDNN's.

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

from gpu_worker.models.cpu_linear import kernel_rows
from gpu_worker.native.compiled_library import load_or_warn
from gpu_worker.native.profiled_range import call_named, profiling
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

SOURCE = Path(__file__).with_name("cpu_linear_bf16.c")
AMX_FLAG = "amx_bf16"  # a tier that needs it multiplies bfloat16 in oneDNN's AMX tiles instead
STATUS_MESSAGES = {1: "sizes or strides outside the kernel's limits", 3: "no memory for the argmax's running bests",
                   4: "a build without AVX-512 BF16"}

_i64, _pointer, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# x, x_stride, packed, bias, out, out_stride, num_rows, in_features, out_features, threads
_LINEAR_ARGTYPES = [_pointer, _i64, _pointer, _pointer, _pointer, _i64, _i64, _i64, _i64, _int]
_LINEAR_ARGMAX_ARGTYPES = [*_LINEAR_ARGTYPES[:-1], _pointer, _int]  # ..., out_features, tokens, threads


class PairLinearKernel:
    """The loaded kernel: its column tile width, its pair layout, and its product."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.pagedserve_linear_bf16_tile_columns.restype = ctypes.c_int
        self.tile_columns: int = library.pagedserve_linear_bf16_tile_columns()
        self._linear = library.pagedserve_linear_bf16
        self._linear.argtypes, self._linear.restype = _LINEAR_ARGTYPES, ctypes.c_int
        self._linear_argmax = library.pagedserve_linear_bf16_argmax
        self._linear_argmax.argtypes, self._linear_argmax.restype = _LINEAR_ARGMAX_ARGTYPES, ctypes.c_int

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] bfloat16, `in` even -> [tiles, in / 2, tile_columns, 2]: per column tile, each pair of
        in_features' two weights side by side for every column, zero past `out`."""
        out_features, in_features = weight.shape
        num_tiles = -(-out_features // self.tile_columns)
        padded = F.pad(weight.detach(), (0, 0, 0, num_tiles * self.tile_columns - out_features))
        return padded.view(num_tiles, self.tile_columns, in_features // 2, 2).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        """x [rows, in] bfloat16 (each row contiguous) -> a new [rows, out_features] bfloat16."""
        out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
        args = self.call_args(x, packed, bias, out)
        _check(call_named("pagedserve::linear_bf16", self._linear, args) if profiling() else self._linear(*args))
        return out

    def linear_argmax(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """linear, and each row's argmax of the result as the kernel wrote it, over its values as float32
        (torch.argmax's: the lowest column on ties, NaN above everything): ([rows, out_features] bfloat16, [rows]
        int64)."""
        out = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        *args, threads = self.call_args(x, packed, bias, out)
        args = (*args, tokens.data_ptr(), threads)
        _check(call_named("pagedserve::linear_bf16", self._linear_argmax, args) if profiling()
               else self._linear_argmax(*args))
        return out, tokens

    def call(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """linear's product of x [rows, in] into out [rows, out_features] (each row contiguous) as (kernel,
        arguments), to be run later while every tensor named stays alive and in place; it returns linear's
        status."""
        return self._linear, self.call_args(x, packed, bias, out)

    @staticmethod
    def call_args(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> tuple:
        (num_rows, in_features), out_features = x.shape, out.shape[1]
        return (x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), out.stride(0), num_rows, in_features, out_features, torch.get_num_threads())


@functools.cache
def load_pair_linear_kernel(tier: CpuTier) -> PairLinearKernel | None:
    """The kernel where the tier computes bfloat16 natively with 512-bit vectors and has no AMX; None elsewhere or
    (after one warning) if no build loads. On AMX oneDNN multiplies in matrix tiles: on a 16-core Xeon it ran a
    prefill chunk's rows 5x faster than this kernel (0.18-0.20x at 256-2,048 rows, 1.07-1.43x at 1-16)."""
    if not (tier.has_native_bf16 and tier.has_wide_vectors) or AMX_FLAG in tier.needs:
        return None
    library = load_or_warn(SOURCE, logger, "the bfloat16 linear kernel", "oneDNN's packed bfloat16 linear", tier)
    if library is None:
        return None
    library.pagedserve_linear_bf16_supported.restype = ctypes.c_int
    return PairLinearKernel(library) if library.pagedserve_linear_bf16_supported() else None


def _check(status: int) -> None:
    if status:
        raise ValueError(f"linear_bf16: the kernel refused its inputs after they were checked, for "
                         f"{STATUS_MESSAGES.get(status, f'status {status}')}")


class PairTiledLinear(nn.Module):
    """y = x @ W.T + b in bfloat16 (float32 sums), W held in the kernel's pair tiles; built from an nn.Linear's
    bfloat16 weight (in_features even) and bias."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, kernel: PairLinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
            raise ValueError(f"PairTiledLinear takes a bfloat16 weight of even in_features, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.kernel = kernel
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        packed = kernel.pack(weight)  # [tiles, in_features / 2, tile_columns, 2]
        self.register_buffer("packed_weight", packed, persistent=False)  # a buffer: the memory report counts it
        padding = packed.shape[0] * kernel.tile_columns - self.out_features
        self.register_buffer("bias", None if bias is None else F.pad(bias.detach().float(), (0, padding)),
                             persistent=False)  # [tiles * tile_columns] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] bfloat16 -> [..., out_features]."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"PairTiledLinear computes in bfloat16, got {x.dtype}")
        y = self.kernel.linear(kernel_rows(x, self.in_features), self.packed_weight, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, in_features] bfloat16 -> (forward's [rows, out_features], each row's argmax of it [rows] int64),
        the argmax taken as the kernel writes the rows: an LM head's greedy choice."""
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise TypeError(f"PairTiledLinear takes bfloat16 rows, got {x.dtype} of {x.dim()} dimensions")
        return self.kernel.linear_argmax(kernel_rows(x, self.in_features), self.packed_weight, self.bias,
                                         self.out_features)

    def kernel_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """forward's product of x [rows, in_features] into out [rows, out_features] as a kernel call (the kernel
        step's, cpu_kernel_step.py)."""
        return self.kernel.call(x, self.packed_weight, self.bias, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
