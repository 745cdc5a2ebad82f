"""The small layers of a Llama-family block: RMSNorm, rotary embedding, the SiLU-gated activation.

Numerics follow transformers' Llama code so logits match it: RMSNorm
accumulates in float32 and casts back before the weight multiply; rotary
cos/sin are computed in float32 from the positions and cast to q's dtype
(once per forward, shared by every layer).

The per-row ops (RMSNorm with and without the residual add before it,
SiLU * up, rotary) are torch functions here, the reference every faster
implementation is tested against; a model calls them through a LayerOps,
chosen once per device by select_layer_ops: on the CPU, the one-pass C
kernels of cpu_fused.py where they build and beat these on the CPU's tier,
else these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.cpu_tier import CpuTier, current_tier


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The per-row ops of a block. A fast implementation may work in place: callers use what is returned,
    and the tensors handed in (other than weights and cos/sin) are spent."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    apply_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# The vector width from which the SiLU·up kernel beats torch's op on float32 rows (1.2-1.9x from 16 rows on the
# avx2 build; 0.5-1.0x on x86-64's, BENCHMARKS.md); on bfloat16 rows it needs AVX-512 (CpuTier.has_wide_vectors).
SILU_KERNEL_FLOAT32_MIN_VECTOR_BITS = 256


def select_layer_ops(device_type: str, tier: CpuTier | None = None) -> LayerOps:
    """torch's ops on CUDA (and wherever the C kernels do not build); the C kernels on the CPU (tier: this
    process's by default), but for SiLU·up where torch's op is faster: on bfloat16 below AVX-512, and on any dtype
    below AVX2."""
    if device_type != "cpu":
        return TORCH_LAYER_OPS
    from gpu_worker.models.cpu_fused import load_cpu_fused_kernels
    kernels = load_cpu_fused_kernels()
    if kernels is None:
        return TORCH_LAYER_OPS
    tier = tier or current_tier()
    if tier.has_wide_vectors:
        return kernels.layer_ops()
    if tier.vector_bits >= SILU_KERNEL_FLOAT32_MIN_VECTOR_BITS:
        return dataclasses.replace(kernels.layer_ops(), silu_and_mul=kernels.silu_and_mul_float32)
    return dataclasses.replace(kernels.layer_ops(), silu_and_mul=TORCH_LAYER_OPS.silu_and_mul)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim [..., hidden_size]."""
    # One kernel that accumulates in float32 and rounds once to x's dtype, as
    # transformers' upcast -> normalise -> downcast does; the weight multiply
    # stays outside so it too rounds in x's dtype, as there.
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)  # [num_tokens, hidden_size]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a block's output joins the residual stream, which is then normed."""
    residual = x + residual  # [num_tokens, hidden_size], rounded in x's dtype as transformers' residual add is
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: LayerOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [num_tokens, hidden_size] (added to residual first, when there is one) -> (normed rows, residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for the fused [..., 2 * intermediate] output of gate_proj and up_proj (into `out` if given)."""
    gate, up = gate_up.chunk(2, dim=-1)  # each [num_tokens, intermediate_size]
    return torch.mul(F.silu(gate), up, out=out)


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [head_dim // 2]
    inv_freq = 1.0 / (theta ** exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling["rope_type"] == "linear":
        return inv_freq / rope_scaling["factor"]
    return _llama3_scaled(inv_freq, rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: slow frequencies divided by `factor`, fast ones kept, a linear blend between.

    A frequency's wavelength is compared with the pretraining context: longer
    than context / low_freq_factor means fully scaled, shorter than
    context / high_freq_factor means unscaled.
    """
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    context = rope_scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # [head_dim // 2]
    keep = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: scale, 1: keep
    return (1 - keep) * inv_freq / factor + keep * inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin for a batch of positions, looked up once per forward and shared by every layer.

    They come from a table of every position below the longest context seen
    so far (grown to the next power of two when a longer one comes), each row
    computed as transformers computes it: in float32 from the position, then
    cast to the dtype. So the rows are the same as computing them per
    forward, which on the CPU cost about 6% of a small model's decode step
    (sin and cos of every angle, every step).
    """

    inv_freq: torch.Tensor  # [head_dim // 2] float32, a buffer

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, rope_scaling).to(device), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> cos, sin [positions, d]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens], each below max_position (known on the host) -> cos, sin [num_tokens, head_dim]."""
        cos, sin = self._table(dtype, max_position)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, head_dim], computed in float32, returned in dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _table(self, dtype: torch.dtype, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < max_position:
            size = 1 << max(max_position - 1, 1).bit_length()  # the next power of two >= max_position
            table = self._tables[dtype] = self.compute(torch.arange(size, device=self.inv_freq.device), dtype)
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by cos/sin [num_tokens, head_dim] in x's dtype (half-split pairing)."""
    first, second = x.chunk(2, dim=-1)  # each [num_tokens, num_heads, head_dim // 2]
    return x * cos[:, None, :] + torch.cat((-second, first), dim=-1) * sin[:, None, :]


TORCH_LAYER_OPS = LayerOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_and_mul=silu_and_mul,
                           apply_rotary=apply_rotary)
