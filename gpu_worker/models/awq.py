"""AWQ checkpoints (AutoAWQ's GEMM layout, as vLLM serves them): 4-bit weights with a zero point per group.

Owns reading config.json's quantization_config for quant_method awq and
each quantized layer's tensors into a QuantizedWeight with zero points, for
the int4 kernel's zero-point format. What is read, per quantized linear
layer `P` of `in` inputs and `out` outputs, in groups of `group_size`
inputs:

- `P.qweight` int32 [in, out / 8]: each word holds 8 outputs of one input,
  4 bits each, the first in the low bits, in AWQ's interleaved order: the
  word's k-th nibble is output 8 x word + ORDER[k];
- `P.qzeros` int32 [groups, out / 8]: the zero points, packed the same way;
- `P.scales` float16 [groups, out]; w = (q - zero) x scale, q and zero
  unsigned in [0, 16).

Served: 4 bits, `version` gemm, `zero_point` true, groups of any size that
divides the inputs, the lm_head and `modules_to_not_convert` left in float.
Anything else (other versions' layouts: gemv, marlin, exllama; other bit
widths) is a CheckpointError at load naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantization import QuantizedWeight, unpack_words

BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of a word holds, relative to the word's first
_UNORDER = torch.tensor([ORDER.index(output) for output in range(8)])  # the nibble that holds each output


@dataclass(frozen=True)
class AwqScheme:
    group_size: int
    ignore: tuple[str, ...]

    def describe(self) -> str:
        return f"AWQ 4-bit with zero points, in groups of {self.group_size}"

    def read_layer(self, tensors: Mapping[str, torch.Tensor], name: str, file: Path) -> QuantizedWeight:
        q = _unpacked_outputs(tensors, f"{name}.qweight", file).t()  # [out, in], unsigned
        out_features, in_features = q.shape
        scales = tensors[f"{name}.scales"].float().t()  # [out, groups]
        zeros = _unpacked_outputs(tensors, f"{name}.qzeros", file).t()  # [out, groups], unsigned
        groups = in_features // self.group_size
        if in_features % self.group_size or tuple(scales.shape) != (out_features, groups) \
                or tuple(zeros.shape) != (out_features, groups):
            raise CheckpointError(f"{file}: {name}'s scales {list(scales.t().shape)} and zero points "
                                  f"{list(zeros.t().shape)} are not [{groups}, {out_features}] for "
                                  f"{self.describe()}")
        middle = 1 << (BITS - 1)
        return QuantizedWeight("int4", (q - middle).to(torch.int8).contiguous(), scales.contiguous(),
                               self.group_size, (zeros - middle).to(torch.int8).contiguous())


def read_scheme(config: dict, path: Path) -> AwqScheme:
    """config.json's quantization_config (quant_method awq) -> the scheme, or CheckpointError naming what is not
    served."""
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size"))
    version = str(config.get("version", "gemm")).lower()
    problem = None
    if bits != BITS:
        problem = f"{bits}-bit weights (only 4)"
    elif version != "gemm":
        problem = f"version {version!r} (only gemm's layout)"
    elif not config.get("zero_point", True):
        problem = "no zero points (zero_point false)"
    elif not (isinstance(group_size, int) and group_size > 0):
        problem = f"group_size {group_size!r}"
    if problem or not isinstance(group_size, int):
        raise CheckpointError(f"{path}: the AWQ checkpoint has {problem}, which is not served")
    return AwqScheme(group_size, ("lm_head", *(config.get("modules_to_not_convert") or ())))


def _unpacked_outputs(tensors: Mapping[str, torch.Tensor], name: str, file: Path) -> torch.Tensor:
    """An [rows, out / 8] int32 tensor of AWQ's packing -> [rows, out] unsigned values, outputs in order."""
    try:
        nibbles = unpack_words(tensors[name], BITS, 1)  # [rows, out]: each word's nibbles in their order
    except ValueError as error:
        raise CheckpointError(f"{file}: {name}: {error}") from None
    rows = nibbles.shape[0]
    return nibbles.view(rows, -1, 8)[..., _UNORDER].reshape(rows, -1)
