"""What the tests of quantized checkpoint formats share: writing the config, the reference weights, greedy tokens.

    from helpers.quantized_checkpoints import set_quantization_config, reference_weight, greedy_tokens
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.models.quantized_linear import QuantizedLinear
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the checkpoint's
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # the model's rows
PROMPT = [5, 17, 42, 99, 3, 250, 7]
MAX_TOKENS = 12


def set_quantization_config(path: Path, quantization_config: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


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
