"""A GGUF file's metadata: its key-value fields, and the Hugging Face config.json they describe.

Owns the mapping from llama.cpp's hyperparameter keys (`llama.block_count`,
...) to config.json's, for the architectures the model code runs (llama,
qwen2), and refusing, by name, what it does not: another architecture, RoPE
scaling, a head size the rotary embedding does not cover.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

GGUF_FILE = "model.gguf"  # the link to the served file in its unpacked directory
MAGIC = b"GGUF"
# general.architecture -> config.json's architecture and model_type
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
TORCH_DTYPES = {gguf.GGMLQuantizationType.F16: "float16", gguf.GGMLQuantizationType.BF16: "bfloat16"}


class GgufError(ValueError):
    """A GGUF file this server cannot serve; the message names the file and what it lacks or holds."""


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def open_reader(path: Path) -> gguf.GGUFReader:
    """The file's reader (memory-mapped; nothing but the header is read yet); GgufError when it is not GGUF."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GgufError(f"{path}: not a readable GGUF file ({error})") from None


def fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field by key: strings, numbers, booleans and lists of them, as Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def model_config(meta: dict[str, Any], tensor_types: dict[str, gguf.GGMLQuantizationType], path: Path) -> dict:
    """config.json's contents for a GGUF file's metadata and its tensors' types (by tensor name)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path}: general.architecture {arch!r} is not served; GGUF files of "
                        f"{', '.join(ARCHITECTURES)} models are")
    if "rope_freqs.weight" in tensor_types:
        raise GgufError(f"{path}: holds rope_freqs.weight (Llama 3.1's scaled RoPE), which GGUF files are not "
                        f"served with; serve the Hugging Face checkpoint instead")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise GgufError(f"{path}: {arch}.rope.scaling.type is {scaling!r}; GGUF files with scaled RoPE are not served")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise GgufError(f"{path}: metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GgufError(f"{path}: {arch}.rope.dimension_count is {rotary}, the heads {head_dim} wide; partial "
                        f"rotary embeddings are not served")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    if not vocab_size:
        raise GgufError(f"{path}: metadata gives no vocabulary size (neither {arch}.vocab_size nor tokenizer tokens)")
    float_types = {kind for kind in tensor_types.values() if kind in TORCH_DTYPES}
    architecture, model_type = ARCHITECTURES[arch]
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)), "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_types,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": TORCH_DTYPES[float_types.pop()] if len(float_types) == 1 else "float32",
    }
