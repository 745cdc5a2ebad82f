"""Weight-only quantization schemes: how a float weight becomes integers and scales, and back.

Owns the arithmetic of each scheme, in torch, on plain [out, in] tensors;
knows nothing of kernels or layouts (quantized_linear.py lays the result out
for the kernel). The dequantized weight is what every kernel multiplies by,
so it is the reference the kernels are tested against.

- int8: symmetric, one scale per output channel: scale = max|w| / 127,
  q = round(w / scale) in [-127, 127].
- int4: symmetric, one scale per output channel and group of INT4_GROUP_SIZE
  consecutive input features: scale = max|w| / 7 over the group,
  q = round(w / scale) in [-7, 7] (stored as q + 8 in four bits). Groups of
  32, not 128: a group's scale follows the weights' local range four times
  as closely, for 1 bit of scale per weight (float32 scales), and 32 is
  GGUF Q4_0's block, so such files map onto the same kernel.

Checkpoints quantized already may carry int4 zero points too (AWQ,
asymmetric GPTQ): w = (q - zero) x scale, a zero per output channel and
group, held as QuantizedWeight.zeros in q's range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import INT4_GROUP_SIZE
from shared.config import QUANTIZATION_SCHEMES as SCHEMES


@dataclass(frozen=True)
class QuantizedWeight:
    """q [out, in] int8 (int4 values in [-8, 7] held one per byte); scales [out] (int8 per channel) or
    [out, in / group] (int4, and int8 in groups as GGUF's Q8_0)."""

    scheme: str
    q: torch.Tensor
    scales: torch.Tensor
    group_size: int  # in_features for int8: one group per channel
    zeros: torch.Tensor | None = None  # int4 only, [out, in / group] int8 in [-8, 7]: w = (q - zero) * scale

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the quantized one stands for."""
        out_features, in_features = self.q.shape
        groups = self.q.float().view(out_features, in_features // self.group_size, self.group_size)
        if self.zeros is not None:
            groups = groups - self.zeros.float().view(out_features, -1, 1)
        return (groups * self.scales.view(out_features, -1, 1)).view(out_features, in_features)


def quantize(weight: torch.Tensor, scheme: str, group_size: int | None = None) -> QuantizedWeight:
    """weight [out, in] of any float dtype -> its quantized form under `scheme` (one of SCHEMES), in groups of
    `group_size` inputs (default: int8 per channel, int4 in groups of INT4_GROUP_SIZE)."""
    out_features, in_features = weight.shape
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    largest = 127 if scheme == "int8" else 7
    group_size = group_size or (in_features if scheme == "int8" else INT4_GROUP_SIZE)
    if in_features % group_size:
        raise ValueError(f"{scheme} quantizes groups of {group_size} input features; this layer has {in_features}")
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=2) / largest  # [out, groups]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: any scale, q = 0
    q = torch.round(groups / scales.unsqueeze(2)).clamp(-largest, largest).to(torch.int8)
    flat_scales = scales.view(out_features) if group_size == in_features and scheme == "int8" else scales
    return QuantizedWeight(scheme, q.view(out_features, in_features), flat_scales.contiguous(), group_size)


def unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words packed along `dim` (32 / bits values a word, the first in the low bits), as quantized
    checkpoints store them -> their unsigned values, as int64, that dimension 32 / bits times longer."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed weights are 2-D int32 tensors, got {packed.dtype} {list(packed.shape)}")
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:  # [words, cols] -> [words, per_word, cols] -> [words * per_word, cols]
        values = (words.unsqueeze(1) >> shifts.view(1, per_word, 1)) & ((1 << bits) - 1)
        return values.reshape(-1, packed.shape[1])
    values = (words.unsqueeze(2) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    return values.reshape(packed.shape[0], -1)
