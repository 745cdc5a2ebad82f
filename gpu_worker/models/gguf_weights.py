"""A GGUF file's tensors into the model: float ones copied, Q8_0 and Q4_0 linear layers kept quantized.

Owns llama.cpp's tensor names (NAMES: `blk.3.attn_q.weight` for
`model.layers.3.self_attn.q_proj.weight`), its block formats, and undoing
the one change its converter makes to llama weights: the rows of attn_q and
attn_k are reordered within each head so that RoPE rotates adjacent pairs
(llama.cpp's rope) rather than the two halves (this model's, Hugging
Face's); the rows are put back here, quantized or not, since quantization
runs along the rows' inputs.

Block formats, each row of `in` inputs cut into blocks of 32:

- Q8_0, 34 bytes a block: a float16 scale d, then 32 int8 q; w = d * q.
  Served by the int8 kernel in groups of 32 (the same integers and scales).
- Q4_0, 18 bytes a block: a float16 scale d, then 16 bytes whose byte j
  holds input j in its low four bits and input j + 16 in its high four, as
  unsigned n; w = d * (n - 8). Served by the int4 kernel (q = n - 8).

A linear layer whose tensors are all Q8_0 or all Q4_0 is served by those
kernels; any other type the gguf package can dequantize (F32, F16, BF16,
the K-quants, ...) is read as float into the model's dtype, and a linear
layer dequantized so is logged: correct, but without a kernel for its bytes.
The embedding table is always read as float (a lookup reads a few rows);
a tied lm_head in Q8_0 or Q4_0 still gets its kernel.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from gpu_worker.models.config import CheckpointError, ModelConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.prequantized import merge, quantized_parts
from gpu_worker.models.quantization import QuantizedWeight

logger = logging.getLogger("pagedserve.worker")

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
BLOCK = 32
KERNEL_SCHEMES = {Q8_0: "int8", Q4_0: "int4"}
FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
# Hugging Face name (a regular expression) -> llama.cpp's
NAMES = {
    r"model\.embed_tokens\.(\w+)": r"token_embd.\1",
    r"model\.norm\.(\w+)": r"output_norm.\1",
    r"lm_head\.(\w+)": r"output.\1",
    r"model\.layers\.(\d+)\.input_layernorm\.(\w+)": r"blk.\1.attn_norm.\2",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.(\w+)": r"blk.\1.ffn_norm.\2",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.(\w+)": r"blk.\1.attn_q.\2",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.(\w+)": r"blk.\1.attn_k.\2",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.(\w+)": r"blk.\1.attn_v.\2",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.(\w+)": r"blk.\1.attn_output.\2",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.(\w+)": r"blk.\1.ffn_gate.\2",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.(\w+)": r"blk.\1.ffn_up.\2",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.(\w+)": r"blk.\1.ffn_down.\2",
}
_COMPILED = [(re.compile(pattern), replacement) for pattern, replacement in NAMES.items()]


def gguf_name(name: str) -> str:
    """llama.cpp's name for the Hugging Face tensor `name`; CheckpointError for one it has no name for."""
    for pattern, replacement in _COMPILED:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise CheckpointError(f"the model needs {name}, which GGUF files have no name for")


def load_gguf_weights(model: LlamaForCausalLM, config: ModelConfig, path: Path) -> dict[str, QuantizedWeight]:
    """Fill `model` from the GGUF file at `path`; the linear modules served quantized -> their weights (the caller
    puts them in), all else copied into the model."""
    reader = gguf.GGUFReader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    reordered = _rope_reordered_heads(reader, config)
    checkpoint = model.checkpoint_tensors()
    names = {name: gguf_name(name) for name in checkpoint}
    missing = [theirs for theirs in names.values() if theirs not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing {len(missing)} tensor(s) the model needs: {', '.join(missing[:5])}")
    quantized: dict[str, QuantizedWeight] = {}
    parts_by_module = quantized_parts(model, checkpoint, ignore=())
    for module, parts in parts_by_module.items():
        types = {tensors[names[f"{part}.weight"]].tensor_type for part in parts}
        if len(types) == 1 and types <= KERNEL_SCHEMES.keys():
            quantized[module] = merge([_quantized(tensors[names[f"{part}.weight"]], reordered.get(part), path)
                                       for part in parts])
    # what only quantized linears read; a tied lm_head's table stays the embeddings' too
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    served = {f"{part}.weight" for module in quantized for part in parts_by_module[module]} - embeddings
    dequantized: Counter[str] = Counter()
    with torch.no_grad():
        for name, target in checkpoint.items():
            if name in served:
                continue
            tensor = tensors[names[name]]
            values = _float(tensor, path)
            if tuple(values.shape) != tuple(target.shape):
                raise CheckpointError(f"{path}: tensor {tensor.name!r} has shape {list(values.shape)}, expected "
                                      f"{list(target.shape)}")
            target.copy_(_rows_put_back(values, reordered.get(name.rpartition(".")[0])))
            if tensor.tensor_type not in FLOAT_TYPES and name not in embeddings:  # a lookup reads a few rows
                dequantized[tensor.tensor_type.name] += 1
    if dequantized:
        logger.warning("%s: dequantized %s to %s (only Q8_0 and Q4_0 linear layers are served quantized)", path.name,
                       ", ".join(f"{count} {kind} tensor(s)" for kind, count in sorted(dequantized.items())),
                       str(next(iter(checkpoint.values())).dtype).removeprefix("torch."))
    return quantized


def _rope_reordered_heads(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, int]:
    """Hugging Face module name -> its head count, for each projection whose rows llama.cpp reordered for its rope
    (llama's q and k; qwen2 uses the halves' rotation, as this model does, and keeps them)."""
    architecture = reader.fields["general.architecture"].contents()
    if architecture != "llama":
        return {}
    reordered = {}
    for layer in range(config.num_hidden_layers):
        reordered[f"model.layers.{layer}.self_attn.q_proj"] = config.num_attention_heads
        reordered[f"model.layers.{layer}.self_attn.k_proj"] = config.num_key_value_heads
    return reordered


def _rows_put_back(rows: torch.Tensor, heads: int | None) -> torch.Tensor:
    """Undo llama.cpp's reordering of a q or k projection's rows (each head's two halves interleaved), for a
    tensor of one row per output ([out, ...]: a weight, its scales or its bias); others pass unchanged."""
    if heads is None:
        return rows
    head_dim = rows.shape[0] // heads
    theirs = torch.arange(rows.shape[0]).view(heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    ours = torch.empty_like(rows)
    ours[theirs] = rows
    return ours


def _blocks(tensor, block_bytes: int, path: Path) -> np.ndarray:
    """A quantized tensor's bytes as [rows, blocks, block_bytes]."""
    data = np.asarray(tensor.data)
    if data.ndim != 2 or data.shape[1] % block_bytes:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} is not a matrix of whole {tensor.tensor_type.name} "
                              f"blocks (bytes {list(data.shape)})")
    return data.reshape(data.shape[0], -1, block_bytes)


def _quantized(tensor, heads: int | None, path: Path) -> QuantizedWeight:
    """A Q8_0 or Q4_0 tensor as the integers and scales of the int8 or int4 kernel (module docstring)."""
    scheme = KERNEL_SCHEMES[tensor.tensor_type]
    blocks = _blocks(tensor, 2 + (BLOCK if scheme == "int8" else BLOCK // 2), path)
    rows = blocks.shape[0]
    scales = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32))
    payload = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]))
    if scheme == "int8":
        q = payload.view(torch.int8)
    else:
        q = torch.cat([payload & 15, payload >> 4], dim=2).to(torch.int8) - 8  # inputs j, then j + 16, of a block
    q = q.reshape(rows, -1)
    return QuantizedWeight(scheme, _rows_put_back(q, heads).contiguous(), _rows_put_back(scales, heads).contiguous(),
                           BLOCK)


def _float(tensor, path: Path) -> torch.Tensor:
    """Any tensor the gguf package can read, as float32 [rows, ...] in Hugging Face's order."""
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except (NotImplementedError, ValueError) as error:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which cannot be "
                              f"read ({error})") from None
    return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the file is mapped read-only
