"""GGUF files written from a Hugging Face checkpoint, as llama.cpp's converter and quantizer lay them out.

    from helpers.gguf_checkpoints import write_gguf
    gguf_file, reference = write_gguf(checkpoint_dir, tmp_path / "model.gguf", "Q8_0")

The packing is spelled out here, not taken from the gguf package (the
package only writes the container): for a weight w [out, in], each row is cut
into blocks of 32 inputs;
- Q8_0: d = max|w| / 127 over the block, q = round(w / d) (int8), stored as
  float16 d then the 32 q, 34 bytes; w' = f16(d) * q;
- Q4_0: m = the block's value of largest magnitude, d = m / -8,
  n = min(15, trunc(w / d + 8.5)) (unsigned 4 bits); stored as float16 d then
  16 bytes, byte j holding input j in its low half and j + 16 in its high
  half; w' = f16(d) * (n - 8).
The converter's one change to llama weights is made too: the rows of q_proj
and k_proj are reordered within each head, each head's two halves
interleaved (llama.cpp rotates adjacent pairs). `reference` is a float
checkpoint of the dequantized weights w' in Hugging Face's order, beside the
file, that the GGUF model must compute like. The tokenizer goes in as
llama.cpp's "gpt2" metadata: tokens in id order, their types, the merges.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

BLOCK = 32
NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
LINEAR_SUFFIXES = ("_proj.weight",)


def gguf_tensor_name(name: str) -> str:
    module, _, kind = name.rpartition(".")
    if module in NAMES:
        return f"{NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{kind}"


def quantize_q8_0(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """w [out, in] -> (Q8_0 bytes [out, in / 32 * 34], the dequantized w')."""
    blocks = w.double().view(w.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0).to(torch.int8)
    d16 = d.to(torch.float16)
    data = np.concatenate([d16.numpy().view(np.uint8), q.numpy().view(np.uint8)], axis=2)
    return data.reshape(w.shape[0], -1), (d16.float() * q.float()).view_as(w)


def quantize_q4_0(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """w [out, in] -> (Q4_0 bytes [out, in / 32 * 18], the dequantized w')."""
    blocks = w.float().view(w.shape[0], -1, BLOCK)
    largest = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))
    d = largest / -8
    n = torch.where(d != 0, torch.trunc(blocks / torch.where(d != 0, d, 1) + 8.5), 8).clamp(0, 15).to(torch.uint8)
    packed = n[..., :BLOCK // 2] | (n[..., BLOCK // 2:] << 4)
    d16 = d.to(torch.float16)
    data = np.concatenate([d16.numpy().view(np.uint8), packed.numpy()], axis=2)
    return data.reshape(w.shape[0], -1), (d16.float() * (n.float() - 8)).view_as(w)


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}


def rope_order(rows: int, heads: int) -> torch.Tensor:
    """The Hugging Face row each row of llama.cpp's q_proj or k_proj holds: each head's two halves interleaved."""
    head_dim = rows // heads
    return torch.arange(rows).view(heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)


def write_gguf(checkpoint: Path, out: Path, linear_type: str = "Q8_0", *, embedding_type: str = "F32",
               tokenizer_dir: Path | None = None, architecture: str = "llama") -> tuple[Path, Path]:
    """A GGUF file at `out` of the float checkpoint `checkpoint` (linear layers in `linear_type`: Q8_0, Q4_0 or
    F32; the embedding table, and so a tied lm_head, in `embedding_type`), and the reference checkpoint of what it
    holds, dequantized. The tokenizer is `tokenizer_dir`'s (default: the checkpoint's)."""
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    writer = gguf.GGUFWriter(out, architecture)
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, tokenizer_dir or checkpoint, config)
    dequantized = {}
    for name, tensor in tensors.items():
        tensor = tensor.float()
        heads = None
        if architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
        stored = tensor if heads is None else tensor[rope_order(tensor.shape[0], heads)]
        kind = linear_type if name.endswith(LINEAR_SUFFIXES) or name == "lm_head.weight" else "F32"
        kind = embedding_type if name == "model.embed_tokens.weight" else kind
        if kind in QUANTIZERS:
            data, values = QUANTIZERS[kind](stored)
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=gguf.GGMLQuantizationType[kind])
            dequantized[name] = values
            if heads is not None:  # back to Hugging Face's order
                dequantized[name] = torch.empty_like(values)
                dequantized[name][rope_order(tensor.shape[0], heads)] = values
        else:
            writer.add_tensor(gguf_tensor_name(name), stored.numpy())
            dequantized[name] = tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = out.with_name(out.stem + "-reference")
    shutil.copytree(checkpoint, reference, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({name: value.contiguous() for name, value in dequantized.items()}, reference / "model.safetensors")
    return out, reference


def _write_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path, config: dict) -> None:
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = [""] * config["vocab_size"]
    types = [gguf.TokenType.UNUSED] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    for index, token in enumerate(tokens):
        if not token:
            tokens[index] = f"[PAD{index}]"
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    settings_file = tokenizer_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])
