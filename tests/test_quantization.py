"""Weight-only quantization at load: the schemes' arithmetic, and which layers of a loaded model they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gpu_worker.models import load_model
from gpu_worker.models.quantization import quantize
from gpu_worker.models.quantized_linear import QuantizedLinear, quantize_linears
from server.__main__ import build_parser, server_config_from_args
from shared.config import INT4_GROUP_SIZE, EngineConfig
from shared.cpu_tier import current_tier, tier_named

from helpers.checkpoints import make_checkpoint


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme,levels", [("int8", 127), ("int4", 7)])
def test_each_weight_is_within_half_a_step_of_its_group_scale(scheme: str, levels: int) -> None:
    weight = _weight(96, 128, seed=1)
    quantized = quantize(weight, scheme)
    assert quantized.q.dtype == torch.int8 and int(quantized.q.abs().max()) == levels
    steps = quantized.scales.view(96, -1).repeat_interleave(quantized.group_size, dim=1)  # [out, in]
    assert torch.all((quantized.dequantized() - weight).abs() <= steps / 2 + 1e-6)
    assert quantized.group_size == (128 if scheme == "int8" else INT4_GROUP_SIZE)


def test_int4_scales_follow_each_group_of_32_inputs() -> None:
    weight = torch.ones(2, 64)
    weight[:, 32:] = 100.0  # a second group a hundred times larger: its own scale keeps the first exact
    quantized = quantize(weight, "int4")
    assert quantized.scales.shape == (2, 2)
    assert torch.equal(quantized.dequantized(), weight)


def test_an_all_zero_channel_stays_zero_and_bfloat16_weights_quantize_alike() -> None:
    weight = _weight(4, 64, seed=2)
    weight[1] = 0
    for scheme in ("int8", "int4"):
        assert torch.equal(quantize(weight, scheme).dequantized()[1], torch.zeros(64))
        widened = weight.bfloat16().float()
        assert torch.equal(quantize(weight.bfloat16(), scheme).q, quantize(widened, scheme).q)


def test_schemes_and_shapes_it_does_not_take_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="one of int8, int4, got 'fp8'"):
        quantize(_weight(4, 64, seed=3), "fp8")
    with pytest.raises(ValueError, match="groups of 32 input features; this layer has 48"):
        quantize(_weight(4, 48, seed=3), "int4")
    with pytest.raises(ValueError, match="quantization.*int8, int4"):
        EngineConfig(model="unused", quantization="fp8")


def test_int4_on_layers_not_a_multiple_of_its_groups_is_refused_before_any_worker_starts(tmp_path) -> None:
    checkpoint = make_checkpoint(tmp_path, intermediate_size=100)
    with pytest.raises(ValueError, match="groups of 32 inputs, and this model's intermediate_size 100 is not a "
                                         "multiple of 32; use --quantization int8"):
        server_config_from_args(build_parser().parse_args([str(checkpoint), "-q", "int4"]))
    assert server_config_from_args(build_parser().parse_args([str(checkpoint), "-q", "int8"])).engine.quantization \
        == "int8"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tier_name", ["avx2", "x86-64"])
def test_a_layer_computes_with_its_dequantized_weight_with_or_without_the_kernel(scheme: str, tier_name: str) -> None:
    """x86-64 has no tiled kernel: the layer multiplies by the dequantized weight with F.linear instead."""
    weight, bias = _weight(80, 64, seed=4), torch.randn(80)
    model = nn.Sequential(nn.Linear(64, 80))
    with torch.no_grad():
        model[0].load_state_dict({"weight": weight, "bias": bias})
    assert quantize_linears(model, scheme, tier_named(tier_name)) == 1
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and (layer.kernel is None) == (tier_name == "x86-64")
    x = torch.randn(5, 64)
    reference = F.linear(x.double(), quantize(weight, scheme).dequantized().double(), bias.double())
    assert torch.allclose(layer(x).double(), reference, rtol=1e-5, atol=1e-4)
    x16 = x.bfloat16()
    got = layer(x16)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 80)
    assert torch.allclose(got.double(), F.linear(x16.double(), quantize(weight, scheme).dequantized().double(),
                                                 bias.double()), rtol=1e-2, atol=0.1)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_loaded_model_quantizes_every_decoder_linear_and_the_lm_head_to_int8(tmp_path, scheme: str,
                                                                               tied: bool) -> None:
    path = make_checkpoint(tmp_path, "llama", hidden_size=64, intermediate_size=128, tie_word_embeddings=tied)
    model, config = load_model(path, dtype="float32", attention=_no_attention, tier=current_tier(),
                               quantization=scheme)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert len(layers) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down; the lm_head
    assert {layer.scheme for name, layer in layers.items() if name != "lm_head"} == {scheme}
    assert layers["lm_head"].scheme == "int8"
    tensors = load_file(path / "model.safetensors")
    table = tensors["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, table), "the lookups keep the float table"
    head = quantize(table if tied else tensors["lm_head.weight"], "int8").dequantized()
    hidden = torch.randn(3, config.hidden_size)
    reference = F.linear(hidden.double(), head.double()).float()
    assert torch.allclose(model.compute_logits(hidden), reference, rtol=1e-5, atol=1e-5)


def _no_attention(*args, **kwargs):
    raise AssertionError("compute_logits runs no attention")
