"""Checkpoints quantized by llm-compressor: the compressed-tensors format, W8A16 and W4A16, read into QuantizedLinear.

Owns reading config.json's `quantization_config` (refusing what is not
implemented, by name) and each quantized layer's tensors. The model, the
kernels and the layout for them are the other modules' (quantized_linear.py).

What is read, per quantized linear layer `P` (a checkpoint name such as
`model.layers.0.self_attn.q_proj`), for weights `num_bits` wide:

- format `pack-quantized`: `P.weight_packed` int32 [out, in * num_bits / 32],
  each word holding 32 / num_bits consecutive inputs, the first in the low
  bits, each as q + 2^(num_bits - 1) (unsigned); `P.weight_shape` [out, in];
- format `int-quantized` (8 bits): `P.weight` int8 [out, in], q itself;
- both: `P.weight_scale` [out, 1] (strategy `channel`) or
  [out, in / group_size] (strategy `group`), w = q x scale.

Served: symmetric integer weights of 8 bits per channel (the int8 kernel) or
4 bits per channel or group (the int4 kernel), activations unquantized
(`input_activations` null), one config group for every Linear, the layers
in `ignore` (the lm_head) left as they are. Anything else (asymmetric
zero points, W8A8's activation quantization, float8, several config
groups) is a CheckpointError at load naming it. prequantized.py decides
that a checkpoint is compressed-tensors and finds the layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantization import QuantizedWeight, unpack_words

FORMATS = ("pack-quantized", "int-quantized")
STRATEGIES = ("channel", "group")
SCHEMES = {8: "int8", 4: "int4"}  # num_bits -> the kernel scheme that computes with them


@dataclass(frozen=True)
class CompressedScheme:
    """How a compressed-tensors checkpoint's linear weights are stored."""

    format: str  # one of FORMATS
    num_bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    ignore: tuple[str, ...]  # module names left unquantized, e.g. lm_head

    @property
    def scheme(self) -> str:
        return SCHEMES[self.num_bits]

    def describe(self) -> str:
        per = "per channel" if self.group_size is None else f"in groups of {self.group_size}"
        return f"compressed-tensors {self.format} W{self.num_bits}A16, {per}"

    def read_layer(self, tensors: Mapping[str, torch.Tensor], name: str, file: Path) -> QuantizedWeight:
        return read_layer(tensors, name, self, file)


def read_scheme(config: dict, path: Path) -> CompressedScheme:
    """config.json's quantization_config (quant_method compressed-tensors) -> the scheme, or CheckpointError."""
    form = config.get("format")
    if form not in FORMATS:
        raise CheckpointError(f"{path}: compressed-tensors format {form!r} is not served; it reads "
                              f"{', '.join(FORMATS)}")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{path}: compressed-tensors with {len(groups)} config groups (a mixed scheme) is not "
                              f"served; one group for every Linear is")
    (name, group), = groups.items()
    if group.get("targets") != ["Linear"]:
        raise CheckpointError(f"{path}: config group {name!r} targets {group.get('targets')}; only ['Linear'] is served")
    if group.get("input_activations") is not None or group.get("output_activations") is not None:
        raise CheckpointError(f"{path}: config group {name!r} quantizes activations (W8A8 and the like); only "
                              f"weight-only schemes (W8A16, W4A16) are served")
    return CompressedScheme(form, *_weight_args(group.get("weights") or {}, name, form, path),
                            tuple(config.get("ignore") or ()))


def _weight_args(weights: dict, group: str, form: str, path: Path) -> tuple[int, int | None]:
    """(num_bits, group_size) of a config group's weights, each property checked."""
    num_bits: int = weights.get("num_bits", 0)
    strategy = weights.get("strategy")
    problem = None
    if weights.get("type") != "int":
        problem = f"weights of type {weights.get('type')!r} (only int)"
    elif not weights.get("symmetric", False):
        problem = "asymmetric weights (zero points)"
    elif num_bits not in SCHEMES:
        problem = f"{num_bits}-bit weights (only 4 and 8)"
    elif strategy not in STRATEGIES:
        problem = f"the {strategy!r} strategy (only {', '.join(STRATEGIES)})"
    elif strategy == "group" and num_bits == 8:
        problem = "8-bit weights in groups (8 bits are served per channel)"
    elif strategy == "group" and not (isinstance(weights.get("group_size"), int) and weights["group_size"] > 0):
        problem = f"group_size {weights.get('group_size')!r}"
    elif form == "int-quantized" and num_bits != 8:
        problem = f"int-quantized {num_bits}-bit weights (int-quantized is read for 8 bits)"
    elif weights.get("dynamic", False) or weights.get("actorder"):
        problem = "dynamic or act-order weights"
    if problem:
        raise CheckpointError(f"{path}: config group {group!r} has {problem}, which is not served")
    return num_bits, int(weights["group_size"]) if strategy == "group" else None


def read_layer(tensors: Mapping[str, torch.Tensor], name: str, scheme: CompressedScheme,
               file: Path) -> QuantizedWeight:
    """One checkpoint layer's quantized weight, from the checkpoint's tensors by name; `file` is what errors name."""
    scale = tensors[f"{name}.weight_scale"].float()
    if scheme.format == "int-quantized":
        q = tensors[f"{name}.weight"]
        if q.dtype != torch.int8:
            raise CheckpointError(f"{file}: tensor {name}.weight has dtype {q.dtype}, expected torch.int8")
    else:
        out_features, in_features = (int(size) for size in tensors[f"{name}.weight_shape"].tolist())
        q = unpack(tensors[f"{name}.weight_packed"], scheme.num_bits, in_features)
        if q.shape[0] != out_features:
            raise CheckpointError(f"{file}: {name}.weight_packed has {q.shape[0]} rows, weight_shape says "
                                  f"{out_features}")
    out_features, in_features = q.shape
    group_size = in_features if scheme.group_size is None else scheme.group_size
    if in_features % group_size or tuple(scale.shape) != (out_features, in_features // group_size):
        raise CheckpointError(f"{file}: {name}.weight_scale has shape {list(scale.shape)}, expected "
                              f"{[out_features, in_features // group_size]} for {scheme.describe()}")
    scales = scale.reshape(out_features) if scheme.scheme == "int8" else scale.contiguous()
    return QuantizedWeight(scheme.scheme, q, scales, group_size)


def unpack(packed: torch.Tensor, num_bits: int, in_features: int) -> torch.Tensor:
    """weight_packed int32 [out, words] -> q int8 [out, in_features] (the format's packing: module docstring)."""
    try:
        codes = unpack_words(packed, num_bits, dim=1)  # [out, words * 32 / num_bits]
    except ValueError as error:
        raise CheckpointError(f"weight_packed: {error}") from None
    if codes.shape[1] < in_features:
        raise CheckpointError(f"weight_packed holds {codes.shape[1]} inputs a row, weight_shape says {in_features}")
    return (codes[:, :in_features] - (1 << (num_bits - 1))).to(torch.int8).contiguous()
