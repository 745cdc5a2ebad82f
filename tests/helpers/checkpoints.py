"""Tiny random-weight Hugging Face checkpoints for tests, written by transformers itself.

    from helpers.checkpoints import make_checkpoint  # pytest puts tests/ on sys.path
    path = make_checkpoint(tmp_path)  # llama, GQA, untied, float32
    path = make_checkpoint(tmp_path, "qwen2", sharded=True, dtype=torch.bfloat16)
    path = make_checkpoint(tmp_path, "llama", rope_scaling="llama3", config_style="4.x")

Each call writes a new directory under tmp_path (config.json,
generation_config.json, safetensors) and returns it. Random weights give
near-uniform logits, where greedy picks flip on last-bit differences, so the
final norm weight is multiplied by `sharpen`: logits then spread over
several units and the top-1 margin is decisive. Norm weights and biases
are jittered away from their 1 / 0 init so a misplaced one changes logits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            bos_token_id=1, eos_token_id=2, initializer_range=0.05)
SMALL_SHARD_SIZE = "100KB"  # splits a TINY model into several shards


def make_checkpoint(tmp_path: Path, arch: str = "llama", *, tie_word_embeddings: bool | None = None,
                    rope_scaling: str | dict | None = None, rope_theta: float = 10000.0,
                    dtype: torch.dtype = torch.float32, sharded: bool = False, config_style: str = "5.x",
                    sharpen: float = 16.0, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny random checkpoint of `arch` ("llama", "mistral" or "qwen2") and return its directory.

    tie_word_embeddings: None takes the architecture's habit (qwen2 tied, others untied).
    rope_scaling: None, "llama3" (LLAMA3_ROPE_SCALING) or a rope_scaling dict.
    sharded: save with a small max_shard_size, so model.safetensors.index.json + shards.
    config_style: "5.x" (rope_parameters, dtype) or "4.x" (rope_theta, rope_scaling, torch_dtype).
    config_overrides: any other config field, e.g. num_key_value_heads=4 (no GQA), num_hidden_layers=4.
    """
    config_class, model_class = ARCHITECTURES[arch]
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_parameters.update(LLAMA3_ROPE_SCALING if rope_scaling == "llama3" else rope_scaling)
    fields = {**TINY, "tie_word_embeddings": arch == "qwen2" if tie_word_embeddings is None else tie_word_embeddings,
              "rope_parameters": rope_parameters, **config_overrides}
    if arch == "mistral":
        fields.setdefault("sliding_window", None)
    torch.manual_seed(seed)
    model = model_class(config_class(**fields))
    with torch.no_grad():
        _perturb_vectors(model, fields["initializer_range"])
        model.model.norm.weight.mul_(sharpen)
    path = Path(tempfile.mkdtemp(prefix=f"{arch}-", dir=tmp_path))
    model.to(dtype).save_pretrained(path, max_shard_size=SMALL_SHARD_SIZE if sharded else "1GB")
    if config_style == "4.x":
        rewrite_config_as_4x(path / "config.json")
    elif config_style != "5.x":
        raise ValueError(f"config_style must be '4.x' or '5.x', got {config_style!r}")
    return path


def _perturb_vectors(model: torch.nn.Module, scale: float) -> None:
    """Jitter the norm weights (init 1) and biases (init 0), so loading them into the wrong place shows."""
    for param in model.parameters():
        if param.ndim == 1:
            param.add_(torch.randn_like(param) * scale)


def rewrite_config_as_4x(config_path: Path) -> None:
    """Respell a transformers-5 config.json the way transformers 4.x wrote it."""
    config = json.loads(config_path.read_text())
    rope_parameters = config.pop("rope_parameters")
    config["rope_theta"] = rope_parameters.pop("rope_theta")
    config["rope_scaling"] = None if rope_parameters["rope_type"] == "default" else rope_parameters
    config["torch_dtype"] = config.pop("dtype")
    config_path.write_text(json.dumps(config, indent=2))
