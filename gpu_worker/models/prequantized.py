"""Checkpoints quantized already: which format config.json's quantization_config names, and which layers it fills.

Owns the dispatch on `quant_method` (compressed-tensors, gptq, awq; anything
else is refused naming what is read) and the mapping from the model's
linear modules to the checkpoint layers whose quantized tensors fill them
(a fused qkv_proj by q_proj, k_proj and v_proj, their rows stacked). Each
format's module (compressed_tensors.py, gptq.py, awq.py) reads its own tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from gpu_worker.models import awq, compressed_tensors, gptq
from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantization import QuantizedWeight

READERS = {"compressed-tensors": compressed_tensors.read_scheme, "gptq": gptq.read_scheme, "awq": awq.read_scheme}


class PrequantizedScheme(Protocol):
    ignore: tuple[str, ...]  # module names the checkpoint leaves in float

    def describe(self) -> str: ...

    def read_layer(self, tensors: Mapping[str, torch.Tensor], name: str, file: Path) -> QuantizedWeight:
        """Checkpoint layer `name`'s weight from the checkpoint's tensors (read as they are looked up; a missing
        one is a CheckpointError); errors name `file`."""
        ...


def read_scheme(raw_config: dict, path: Path) -> PrequantizedScheme | None:
    """config.json's quantization_config -> its scheme; None when the checkpoint is not quantized."""
    config = raw_config.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in READERS:
        raise CheckpointError(f"{path}: quantization_config's quant_method {method!r} is not served; pagedserve "
                              f"reads {', '.join(READERS)} checkpoints, or quantizes a float one at load with "
                              f"--quantization int8 | int4")
    return READERS[method](config, path)


def quantized_parts(model: nn.Module, checkpoint_tensors: dict[str, torch.Tensor],
                    ignore: Collection[str]) -> dict[str, list[str]]:
    """Module name -> the checkpoint layers (`P`s, in row order) whose quantized tensors fill it, for every
    nn.Linear not in `ignore` (by name, or by the name's last part); a fused module (qkv_proj) is filled by
    several."""
    parts: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module_name.rpartition(".")[2] in ignore or module_name in ignore:
            continue
        storage = module.weight.untyped_storage().data_ptr()
        rows = [(tensor.storage_offset(), name.removesuffix(".weight")) for name, tensor in checkpoint_tensors.items()
                if name.endswith(".weight") and tensor.untyped_storage().data_ptr() == storage]
        parts[module_name] = [name for _, name in sorted(rows)]
    return parts


def merge(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The row blocks of a fused module (q, k, v) as one weight: rows and their scales stacked."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any((part.scheme, part.group_size, part.zeros is None) != (first.scheme, first.group_size, first.zeros is None)
           for part in parts):
        raise CheckpointError("the parts of a fused layer are quantized differently: " + ", ".join(
            f"{part.scheme} in groups of {part.group_size}{'' if part.zeros is None else ' with zero points'}"
            for part in parts))
    zeros = None if first.zeros is None else torch.cat([part.zeros for part in parts if part.zeros is not None])
    return QuantizedWeight(first.scheme, torch.cat([part.q for part in parts]),
                           torch.cat([part.scales for part in parts]).contiguous(), first.group_size, zeros)
