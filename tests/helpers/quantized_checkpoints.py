"""What the tests of quantized checkpoint formats share: writing the config, the reference weights, greedy tokens.

    from helpers.quantized_checkpoints import write_quantized_copy, reference_weight, greedy_tokens, pack_words
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.models.quantized_linear import QuantizedLinear
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the checkpoint's
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # the model's rows
PROMPT = [5, 17, 42, 99, 3, 250, 7]
LayerTensors = tuple[dict[str, torch.Tensor], torch.Tensor]  # a layer's tensors in a format, its dequantized weight
MAX_TOKENS = 12


def set_quantization_config(path: Path, quantization_config: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values (int64) -> int32 words packed along `dim`: 32 / bits values a word, the first in the low bits."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, per_word)
    words = torch.stack([groups[..., i] << (bits * i) for i in range(per_word)]).sum(dim=0)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the word's bits as a signed int32
    return words.movedim(-1, dim).contiguous()


def write_quantized_copy(source: Path, out: Path, quantize_layer: Callable[[str, torch.Tensor], LayerTensors],
                         quantization_config: dict) -> Path:
    """A copy of the float checkpoint `source` at `out` in a quantized format, and beside it `out`-reference with
    the dequantized float weights; returns the reference's directory. quantize_layer(P, w) turns each decoder
    linear `P` of weight w into (the format's tensors for it, by name; the dequantized weight); config.json gets
    `quantization_config`."""
    reference = out.with_name(out.name + "-reference")
    for directory in (out, reference):
        shutil.copytree(source, directory)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.rpartition(".")[2] in LINEARS):
            quantized[name] = dequantized[name] = tensor
            continue
        tensors, dequantized[name] = quantize_layer(layer, tensor)
        quantized.update(tensors)
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file({name: tensor.contiguous() for name, tensor in dequantized.items()}, reference / "model.safetensors",
              metadata={"format": "pt"})
    set_quantization_config(out, quantization_config)
    return reference


def reference_weight(tensors: dict[str, torch.Tensor], module_name: str) -> torch.Tensor:
    """The float weight of the model's module `module_name` (a fused one stacks its checkpoint parts)."""
    prefix, _, module = module_name.rpartition(".")
    return torch.cat([tensors[f"{prefix}.{part}.weight"] for part in FUSED.get(module, (module,))])


def assert_layers_compute_with(model: nn.Module, dequantized: dict[str, torch.Tensor], scheme: str) -> None:
    """Every QuantizedLinear of a loaded model (the decoder's, not the lm_head) is under `scheme` and computes what
    its float reference weight in `dequantized` (a checkpoint's tensors) computes."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert layers and "lm_head" not in layers
    x = torch.randn(5, max(layer.in_features for layer in layers.values()), generator=torch.Generator().manual_seed(0))
    for name, layer in layers.items():
        assert layer.scheme == scheme, name
        weight, rows = reference_weight(dequantized, name), x[:, :layer.in_features]
        # Sums of up to 256 products of unit normals and weights of ~0.05: float32 in any order stays within 1e-5.
        assert torch.allclose(layer(rows), F.linear(rows.double(), weight.double()).float(), rtol=1e-5, atol=1e-5), name


def greedy_tokens(path: Path) -> list[int]:
    """The in-process engine's greedy tokens for PROMPT on the checkpoint at `path`, EOS ignored."""
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32, target_itl_ms=0))
    [completion] = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return completion.token_ids


def no_attention(*args, **kwargs):
    """The attention function of a model that runs only its linear layers here."""
    raise AssertionError("these tests run no attention")
