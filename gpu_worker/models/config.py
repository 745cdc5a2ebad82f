"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face config.json.

Owns parsing and validating config.json (and generation_config.json's
eos_token_id). Knows nothing about weights or attention. Both spellings that
transformers has written are accepted: 4.x puts `rope_theta`, `rope_scaling`
and `torch_dtype` at the top level; 5.x nests the rope settings in
`rope_parameters` and names the dtype `dtype`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The keys each supported rope_scaling type needs; plain RoPE ("default") is rope_scaling None.
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
CHECKPOINT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Defaults transformers' LlamaConfig uses when a key is absent.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_POSITION_EMBEDDINGS = 2048


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the problem."""


@dataclass(slots=True)
class ModelConfig:
    """What the model code needs from config.json, normalised across transformers versions.

    `rope_scaling` is None for plain RoPE, else a dict with `rope_type`
    ("linear" or "llama3") and that type's parameters. `attention_bias` is
    the q/k/v projections' bias; `o_proj_bias` is the output projection's
    (Llama's attention_bias sets both, Qwen2 has the first only).
    `sliding_window` is not applied: attention always sees the whole
    context, which matches the checkpoint up to that many tokens, so
    `max_context_len` stops there.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = _DEFAULT_RMS_NORM_EPS
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    max_position_embeddings: int = _DEFAULT_MAX_POSITION_EMBEDDINGS
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def max_context_len(self) -> int:
        """Longest context this implementation serves exactly as the checkpoint would."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(SUPPORTED_ARCHITECTURES)}, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads, got {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)


def _check_rope_scaling(rope_scaling: dict) -> None:
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(f"rope type must be one of default, {', '.join(ROPE_SCALING_KEYS)}, got {rope_type!r}")
    missing = [key for key in ROPE_SCALING_KEYS[rope_type] if key not in rope_scaling]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}; got {rope_scaling}")


def read_model_config(model_dir: Path) -> ModelConfig:
    """Parse model_dir/config.json (and generation_config.json if present) into a ModelConfig."""
    path = Path(model_dir) / "config.json"
    raw = _read_json(path)
    for key in _REQUIRED_KEYS:
        if key not in raw:
            raise CheckpointError(f"{path}: missing required key {key!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act must be 'silu', got {raw['hidden_act']!r}")
    if raw.get("mlp_bias", False):
        raise CheckpointError(f"{path}: mlp_bias=true is not supported")
    architecture = _architecture(raw, path)
    rope_theta, rope_scaling = _rope(raw)
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    generation_path = Path(model_dir) / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", _DEFAULT_MAX_POSITION_EMBEDDINGS),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
            torch_dtype=_checkpoint_dtype(raw, path),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_token_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            sliding_window=_sliding_window(raw, is_qwen2),
        )
    except CheckpointError:
        raise  # already names the file
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None


def _architecture(raw: dict, path: Path) -> str:
    model_type = raw.get("model_type")
    by_model_type = _ARCHITECTURE_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    architecture = (raw.get("architectures") or [by_model_type])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        found = raw.get("architectures") or f"model_type {model_type!r}"
        raise CheckpointError(f"{path}: unsupported architecture {found}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling; rope_scaling is None for plain RoPE."""
    parameters = raw.get("rope_parameters")
    if parameters is not None:  # transformers 5.x: one dict holds theta and scaling
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
        theta = parameters.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    else:  # transformers 4.x
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", _DEFAULT_ROPE_THETA)
    if "type" in scaling:  # the oldest spelling of rope_type
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _checkpoint_dtype(raw: dict, path: Path) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"{path}: dtype must be one of {', '.join(CHECKPOINT_DTYPES)}, got {name!r}")
    return CHECKPOINT_DTYPES[name]


def _eos_token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos_token_id (each an int, a list or absent)."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _sliding_window(raw: dict, is_qwen2: bool) -> int | None:
    if is_qwen2 and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")
