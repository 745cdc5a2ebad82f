"""Writing the trained model as a Hugging Face checkpoint directory, plus its evaluation files and model card.

Owns config.json, generation_config.json, model.safetensors (bfloat16, tied
embeddings so no lm_head.weight), eval/validation.json (the held-out text,
one string per work), eval/words.txt (the training text's word list) and
MODEL.md. Knows nothing about how the model was trained beyond the figures
it is handed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.training.model import LlamaForCausalLM, ModelShape

WEIGHTS_DTYPE = torch.bfloat16
EVAL_DIR = "eval"
VALIDATION_FILE = "validation.json"
WORDS_FILE = "words.txt"


def model_config(shape: ModelShape, ids: dict[str, int]) -> dict:
    """config.json for transformers 4.x (rope_theta, torch_dtype) and 5.x (rope_parameters, dtype) alike."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
    }


def generation_config(ids: dict[str, int]) -> dict:
    return {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
            "do_sample": True, "temperature": 0.8, "top_p": 0.95}


def shipped_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Hugging Face names -> bfloat16 tensors; the rotary tables are recomputed on load, not stored."""
    return {name: tensor.detach().to(WEIGHTS_DTYPE).contiguous() for name, tensor in model.state_dict().items()}


def round_to_shipped(model: LlamaForCausalLM) -> None:
    """Round the weights through bfloat16 in place, so figures measured afterwards are the shipped model's."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(WEIGHTS_DTYPE).float())


def save_checkpoint(model: LlamaForCausalLM, ids: dict[str, int], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(model_config(model.shape, ids), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(ids), indent=2) + "\n")
    weights = out_dir / "model.safetensors"
    save_file(shipped_state_dict(model), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it owner-only; a shipped file is world-readable like the rest


def save_eval_files(validation_texts: list[str], words: list[str], out_dir: Path) -> None:
    eval_dir = out_dir / EVAL_DIR
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / VALIDATION_FILE).write_text(json.dumps(validation_texts, ensure_ascii=False, indent=0) + "\n")
    (eval_dir / WORDS_FILE).write_text("\n".join(words) + "\n")


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
