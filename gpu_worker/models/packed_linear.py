"""Linear layers on the CPU with their weights reordered once, at load: float32 ones into cpu_linear.py's column
tiles from AVX2 up, bfloat16 ones into cpu_linear_bf16.py's pair tiles where bfloat16 is native, the others into
oneDNN's blocked layout.

Owns choosing and building the CPU's linear layers. Knows nothing of which
layer is which: it rewrites every nn.Linear of a loaded model in place.

Why: torch's `F.linear` hands a plain [out, in] weight to the matrix library
on every call, which then works from that layout; in float32 that library
is MKL, which on an AMD CPU does not take its AVX-512 path. Reordering the
weight once into the blocked layout oneDNN's kernels read
(`mkldnn::_reorder_linear_weight`, the same packing torch.compile's CPU
backend uses) and calling `mkldnn::_linear_pointwise` with it runs the same
products, measured with tools/bench/kernels/bench_linear.py at the engine's row counts
(1-2,048) on a 2-core AVX-512 EPYC, 2.2-4.5x faster in float32 and 1.2-2.2x
faster in bfloat16, the most at the few rows of decode steps. bfloat16
results are bit-identical to F.linear (the same kernels, fed a packed
weight); float32 sums in another order, so results differ in the last bits
(relative ~1e-6), as any two BLAS libraries do. From AVX2 up, float32
weights go one step further, into the column tiles of cpu_linear.py's
kernel, which streams them at memory rate at decode row counts (1.3-1.6x
oneDNN there; cpu_linear.py says why); where bfloat16 is native (AVX-512
BF16 without AMX), bfloat16 weights go into the pair tiles of
cpu_linear_bf16.py's kernel, for the same reason.

The packed copy replaces the weight, so memory does not grow, except for a
tied lm_head: the embedding table stays as it is for the lookups and the
packed copy is added for the logits. Where torch has no oneDNN, on other
devices, for other dtypes, or for bfloat16 on a CPU below AVX-512 (torch
refuses to pack it there: shared/cpu_tier.py), the model keeps its
nn.Linear layers.

PackedLinear pads its rows up to a rung of the row ladder
(gpu_worker/native/row_ladder.py), so that oneDNN compiles and caches a
kernel for few row counts; TiledLinear needs no padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.cpu_linear import TiledLinear, load_tiled_linear_kernel
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear, load_pair_linear_kernel
from gpu_worker.native.row_ladder import ladder_rows
from shared.cpu_tier import CpuTier

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor, can_pack_bf16: bool) -> bool:
    """Whether this weight can be packed: a CPU weight of a packed dtype, with oneDNN in this torch; bfloat16 only
    where the CPU tier lets oneDNN pack it (AVX-512 and up: elsewhere torch refuses, and bfloat16 runs unpacked)."""
    packable = PACKED_DTYPES if can_pack_bf16 else (torch.float32,)
    return weight.device.type == "cpu" and weight.dtype in packable and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout; built from an nn.Linear's weight and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # [out, in], blocked
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype, computed on rows padded to ladder_rows."""
        rows = x.numel() // self.in_features
        padding = ladder_rows(rows) - rows
        if padding == 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        padded = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, padding))
        y = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], self.out_features)

    def kernel_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Callable[..., int], tuple]:
        """forward's product of x [rows, in_features] into out [rows, out_features], as a call the kernel step
        (cpu_kernel_step.py) runs as it runs a C kernel's: the same oneDNN product, copied into out."""
        return self._product_into, (x, out)

    def _product_into(self, x: torch.Tensor, out: torch.Tensor) -> int:
        out.copy_(self.forward(x))
        return 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pads_rows(model: nn.Module) -> bool:
    """Whether `model` computes any linear layer on rows padded to the row ladder (it has a PackedLinear)."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def pack_linears(model: nn.Module, tier: CpuTier) -> int:
    """Replace every packable nn.Linear in `model` by a layer of the same weights computed the tier's fastest way:
    float32 by TiledLinear where the tier has its kernel (in paired tiles where the parent names the layer in its
    PAIRED_HALVES: a gated MLP's gate and up projection), bfloat16 by PairTiledLinear where the tier computes it
    natively (an even in_features), else by a PackedLinear (bfloat16 ones only where the tier lets oneDNN pack
    them); how many were replaced."""
    tiled, pairs = load_tiled_linear_kernel(tier), load_pair_linear_kernel(tier)
    # Only (parent, name) pairs are held, so each plain weight is freed as soon as its packed copy replaces it:
    # memory peaks at one layer's two copies, not the whole model's.
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and can_pack(child.weight, tier.can_pack_bf16)]
    for parent, name in targets:
        linear = getattr(parent, name)
        if tiled is not None and linear.weight.dtype == torch.float32:
            paired = name in getattr(parent, "PAIRED_HALVES", ())  # a gated MLP's gate and up: SiLU·up as computed
            setattr(parent, name, TiledLinear(tiled, linear.weight, linear.bias, paired_halves=paired))
        elif pairs is not None and linear.weight.dtype == torch.bfloat16 and linear.in_features % 2 == 0:
            setattr(parent, name, PairTiledLinear(pairs, linear.weight, linear.bias))
        else:
            setattr(parent, name, PackedLinear(linear.weight, linear.bias))
        del linear
    return len(targets)
