"""Linear layers with weights quantized at load (--quantization int8 | int4), and which layers get them.

Owns QuantizedLinear and quantize_linears. Knows nothing of checkpoints or
kernels' insides: quantization.py turns a weight into integers and scales,
cpu_linear.py lays them out and multiplies by them.

Activations stay in the model's compute dtype: a bfloat16 model hands the
kernel its rows widened to float32 and gets its output rounded back, as
F.linear's bfloat16 path accumulates in float32 too. Where the tier has no
tiled kernel (below AVX2, other devices), the layer multiplies by its
dequantized weight with F.linear on every call: correct, and slower than an
unquantized model, which the load says.

Every linear layer of the decoder is quantized under the scheme asked
for, and the lm_head to int8 whatever the scheme (LM_HEAD_SCHEME): at a
decode step's few rows the lm_head is read whole for every step, and at
vocabulary sizes of 32-150k it is a large share of the bytes (SmolLM-135M's
tied 49,152 x 576 is 113 MB in float32, more than its whole decoder in
int8), while one scale per vocabulary row costs the logits little
(BENCHMARKS.md, quantized weights: KL against float32 and the perplexity
with and without it). int8 rather than int4 there, as llama.cpp keeps its
output layer wider than Q4_0: the logits decide every token. The
embeddings keep the compute dtype: a lookup reads a few rows, not the
table; a tied lm_head gets a quantized copy of the table and the lookups
keep the float one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.cpu_linear import TiledLinearKernel, kernel_rows, load_tiled_linear_kernel
from gpu_worker.models.quantization import QuantizedWeight, quantize
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.models")

LM_HEAD = "lm_head"
LM_HEAD_SCHEME = "int8"  # the lm_head's, under either scheme (the module docstring says why)


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(Q).T + b: Q quantized at load (quantize()) or read from a quantized checkpoint."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None  # without a kernel: int4 zero points, if any

    def __init__(self, quantized: QuantizedWeight, bias: torch.Tensor | None, kernel: TiledLinearKernel | None) -> None:
        super().__init__()
        self.scheme, self.group_size = quantized.scheme, quantized.group_size
        self.out_features, self.in_features = quantized.q.shape
        self.kernel = kernel if quantized.q.device.type == "cpu" else None
        self.bias = None if bias is None else bias.detach()
        # Buffers, so that the memory report counts them: the kernel's tiles, or (no kernel) the plain integers.
        if self.kernel is None:
            self.register_buffer("q", quantized.q, persistent=False)  # [out, in]
            self.register_buffer("scales", quantized.scales, persistent=False)
            self.register_buffer("zeros", quantized.zeros, persistent=False)
            return
        grouped_int8 = self.scheme == "int8" and self.group_size != self.in_features  # GGUF's Q8_0
        if self.scheme == "int8":
            self.weight_format = "int8_grouped" if grouped_int8 else "int8"
            packed, scales = self.kernel.pack_int8(quantized.q, quantized.scales.view(self.out_features, -1)
                                                   if grouped_int8 else quantized.scales)
        else:
            self.weight_format = "int4" if quantized.zeros is None else "int4_zero"
            packed, scales = self.kernel.pack_int4(quantized.q, quantized.scales, quantized.zeros)
        self.register_buffer("q", packed, persistent=False)  # the kernel's column tiles
        self.register_buffer("scales", scales, persistent=False)
        padding = packed.shape[0] * self.kernel.tile_columns - self.out_features
        self.padded_bias = None if bias is None else F.pad(bias.detach().float(), (0, padding))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] in the compute dtype -> [..., out_features] in the same dtype."""
        if self.kernel is None:
            weight = QuantizedWeight(self.scheme, self.q, self.scales, self.group_size, self.zeros).dequantized()
            return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        rows = kernel_rows(x.float(), self.in_features)
        y = self.kernel.linear(rows, self.q, self.padded_bias, self.out_features, self.weight_format, self.scales,
                               self.group_size)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """forward's product of x [rows, in_features] float32 into out [rows, out_features] as a kernel call
        (TiledLinearKernel.call); only where the layer has its kernel."""
        if self.kernel is None:
            raise ValueError("a quantized layer without its kernel multiplies in torch: it has no kernel call")
        return self.kernel.call(x, self.q, self.padded_bias, out, self.weight_format, self.scales, self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}, group_size={self.group_size}")


def quantize_linears(model: nn.Module, scheme: str, tier: CpuTier) -> int:
    """Replace every nn.Linear of `model` by a QuantizedLinear: under `scheme`, the lm_head under LM_HEAD_SCHEME;
    how many."""
    schemes = {name: LM_HEAD_SCHEME if name == LM_HEAD else scheme for name, module in model.named_modules()
               if isinstance(module, nn.Linear)}
    return replace_linears(model, {name: quantize(_linear(model, name).weight, each) for name, each in schemes.items()},
                           tier)


def replace_linears(model: nn.Module, weights: dict[str, QuantizedWeight], tier: CpuTier) -> int:
    """Replace each nn.Linear that `weights` names (module name -> its quantized weight, of the linear's shape) by a
    QuantizedLinear on the linear's device, keeping its bias; how many."""
    kernel = load_tiled_linear_kernel(tier)
    linears = {name: _linear(model, name) for name in weights}
    on_cpu = all(linear.weight.device.type == "cpu" for linear in linears.values())
    schemes = ", ".join(sorted({weight.scheme for weight in weights.values()}))
    if weights and (kernel is None or not on_cpu):
        logger.warning("no %s kernel for this %s: the weights are dequantized on every call, which is slower than "
                       "serving unquantized (the quantized kernels need a CPU with AVX2)", schemes,
                       "CPU tier" if on_cpu else "device")
    for name, weight in weights.items():
        linear = linears.pop(name)
        if tuple(weight.q.shape) != tuple(linear.weight.shape):
            raise ValueError(f"{name}: a quantized weight of shape {list(weight.q.shape)} for a linear layer of "
                             f"{list(linear.weight.shape)}")
        device = linear.weight.device
        placed = QuantizedWeight(weight.scheme, weight.q.to(device), weight.scales.to(device), weight.group_size,
                                 None if weight.zeros is None else weight.zeros.to(device))
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, QuantizedLinear(placed, linear.bias, kernel))
        del linear
    return len(weights)


def _linear(model: nn.Module, name: str) -> nn.Linear:
    linear = model.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{name} is a {type(linear).__name__}, not a linear layer to quantize")
    return linear
