"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): 4-bit in groups or per channel, with or without zero points;
8-bit symmetric per channel.

Owns reading config.json's quantization_config for quant_method gptq and
each quantized layer's tensors into a QuantizedWeight for the int4 or int8
kernel. What is read, per quantized linear layer `P`, for weights `bits`
wide and groups of `group_size` inputs (-1: one group, per channel):

- `P.qweight` int32 [in * bits / 32, out]: each word holds 32 / bits
  consecutive inputs of one output column, the first in the low bits, each
  as an unsigned q in [0, 2^bits);
- `P.qzeros` int32 [groups, out * bits / 32]: the zero points, packed the
  same way along the outputs; format `gptq` (v1, the default) stores
  zero - 1, `gptq_v2` the zero itself;
- `P.scales` [groups, out], any float dtype; w = (q - zero) x scale;
- `P.g_idx` int32 [in], when present: each input's group.

Served: no act-order (`desc_act` false, each input in group
i // group_size), 4 bits in groups or per channel, symmetric (`sym` true:
every zero point 2^(bits-1), checked, so that q - zero is the signed integer
the kernels take) or not (the int4 kernel's zero points), 8 bits per
channel and symmetric, the lm_head in float. Anything else is a
CheckpointError at load naming it: act-order, 2 or 3 bits, 8 bits in groups
or with zero points, a quantized lm_head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantization import QuantizedWeight, unpack_words

FORMATS = ("gptq", "gptq_v2")
SCHEMES = {4: "int4", 8: "int8"}  # bits -> the kernel scheme that computes with them


@dataclass(frozen=True)
class GptqScheme:
    bits: int  # 4 or 8
    group_size: int | None  # None: one group per output channel (group_size -1)
    format: str  # one of FORMATS
    symmetric: bool = True
    ignore: tuple[str, ...] = ("lm_head",)

    def describe(self) -> str:
        per = "per channel" if self.group_size is None else f"in groups of {self.group_size}"
        return f"GPTQ {self.bits}-bit {'symmetric' if self.symmetric else 'with zero points'}, {per}"

    def read_layer(self, tensors: Mapping[str, torch.Tensor], name: str, file: Path) -> QuantizedWeight:
        q = _unpacked(tensors, f"{name}.qweight", self.bits, 0, file).t()  # [out, in] unsigned
        out_features, in_features = q.shape
        group_size = in_features if self.group_size is None else self.group_size
        scales = tensors[f"{name}.scales"].float().t()  # [out, groups]
        if in_features % group_size or tuple(scales.shape) != (out_features, in_features // group_size):
            raise CheckpointError(f"{file}: {name}.scales has shape {list(scales.t().shape)}, expected "
                                  f"{[in_features // group_size, out_features]} for {self.describe()}")
        stored = _unpacked(tensors, f"{name}.qzeros", self.bits, 1, file)[:, :out_features]  # [groups, out]
        zeros = stored + (self.format == "gptq")
        middle = 1 << (self.bits - 1)
        if not self.symmetric:
            return QuantizedWeight("int4", (q.long() - middle).to(torch.int8).contiguous(), scales.contiguous(),
                                   group_size, (zeros.t() - middle).to(torch.int8).contiguous())
        if not bool((zeros == middle).all()):
            raise CheckpointError(f"{file}: {name}.qzeros holds zero points other than {middle}, though the "
                                  f"config says sym true")
        if f"{name}.g_idx" in tensors and not torch.equal(
                tensors[f"{name}.g_idx"].long(), torch.arange(in_features) // group_size):
            raise CheckpointError(f"{file}: {name}.g_idx reorders the groups (act-order), which is not served")
        signed = (q.long() - middle).to(torch.int8).contiguous()
        if self.bits == 8:
            return QuantizedWeight("int8", signed, scales.reshape(out_features).contiguous(), in_features)
        return QuantizedWeight("int4", signed, scales.contiguous(), group_size)



def read_scheme(config: dict, path: Path) -> GptqScheme:
    """config.json's quantization_config (quant_method gptq) -> the scheme, or CheckpointError naming what is not
    served."""
    bits: int = config.get("bits", 0)
    group_size = config.get("group_size", -1)
    form = config.get("checkpoint_format", "gptq")
    problem = None
    if bits not in SCHEMES:
        problem = f"{bits}-bit weights (only 4 and 8)"
    elif bits == 8 and not config.get("sym", True):
        problem = "8-bit asymmetric weights (sym false; zero points are served with 4 bits)"
    elif config.get("desc_act", False):
        problem = "act-order (desc_act true)"
    elif not (isinstance(group_size, int) and (group_size == -1 or group_size > 0)):
        problem = f"group_size {group_size!r}"
    elif bits == 8 and group_size != -1:
        problem = "8-bit weights in groups (8 bits are served per channel, group_size -1)"
    elif form not in FORMATS:
        problem = f"checkpoint_format {form!r} (only {', '.join(FORMATS)})"
    elif config.get("lm_head", False):
        problem = "a quantized lm_head"
    if problem:
        raise CheckpointError(f"{path}: the GPTQ checkpoint has {problem}, which is not served")
    return GptqScheme(bits, None if group_size == -1 else group_size, form, bool(config.get("sym", True)))


def _unpacked(tensors: Mapping[str, torch.Tensor], name: str, bits: int, dim: int, file: Path) -> torch.Tensor:
    try:
        return unpack_words(tensors[name], bits, dim)
    except ValueError as error:
        raise CheckpointError(f"{file}: {name}: {error}") from None
