"""compressed-tensors checkpoints (what llm-compressor writes for vLLM): W8A16 and W4A16, read and served.

The tests write the checkpoints themselves from a tiny random float one,
with the format's packing spelled out here (write_compressed): for each
decoder linear `P`, symmetric integer q = round(w / scale) with
scale = max|w| / (2^(bits-1) - 1) per output channel or per group of inputs;
`pack-quantized` stores q + 2^(bits-1) packed 32 / bits to an int32 word
along the inputs, the first in the low bits, as `P.weight_packed`, with
`P.weight_shape` = [out, in]; `int-quantized` stores q as int8 in `P.weight`;
both store `P.weight_scale` [out, groups]. The reference is the float
checkpoint whose weights are q x scale, written beside it: the loaded
layers must compute what it computes, and the engine must produce its
greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.models import load_model
from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantized_linear import QuantizedLinear
from shared.cpu_tier import current_tier

from helpers.checkpoints import make_checkpoint
from helpers.quantized_checkpoints import (
    LayerTensors,
    assert_layers_compute_with,
    greedy_tokens,
    no_attention,
    set_quantization_config,
    write_quantized_copy,
)


def quantized_group(weight: torch.Tensor, bits: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale [out, groups]) of a float weight, symmetric."""
    out_features, in_features = weight.shape
    size = in_features if group_size is None else group_size
    groups = weight.float().view(out_features, in_features // size, size)
    largest = 2 ** (bits - 1) - 1
    scale = groups.abs().amax(dim=2) / largest
    q = torch.round(groups / scale.unsqueeze(2)).clamp(-largest, largest).to(torch.int8)
    return q.view(out_features, in_features), scale


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q int8 [out, in] -> int32 [out, in * bits / 32]: 32 / bits values a word, the first in the low bits, + 2^(bits-1)."""
    per_word = 32 // bits
    codes = (q.to(torch.int64) + 2 ** (bits - 1)).view(q.shape[0], -1, per_word)
    words = torch.stack([codes[:, :, i] << (bits * i) for i in range(per_word)]).sum(dim=0)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the word's bits as a signed int32


def write_compressed(source: Path, out: Path, bits: int, group_size: int | None,
                     form: str = "pack-quantized") -> Path:
    """A compressed-tensors copy of `source` at `out`, and beside it `out`-reference: the dequantized float weights.
    Returns the reference's directory."""

    def quantize_layer(layer: str, tensor: torch.Tensor) -> LayerTensors:
        q, scale = quantized_group(tensor, bits, group_size)
        size = tensor.shape[1] if group_size is None else group_size
        dequantized = (q.float().view(q.shape[0], -1, size) * scale.unsqueeze(2)).view(tensor.shape)
        if form == "int-quantized":
            return {f"{layer}.weight_scale": scale, f"{layer}.weight": q}, dequantized
        return {f"{layer}.weight_scale": scale, f"{layer}.weight_packed": pack(q, bits),
                f"{layer}.weight_shape": torch.tensor(tensor.shape, dtype=torch.int64)}, dequantized

    strategy = {"strategy": "channel"} if group_size is None else {"strategy": "group", "group_size": group_size}
    return write_quantized_copy(source, out, quantize_layer, {
        "quant_method": "compressed-tensors", "format": form, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
                                                  "actorder": None, **strategy}}}})


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("float"), "llama")


SCHEMES = [(4, 32, "pack-quantized"), (4, None, "pack-quantized"), (8, None, "pack-quantized"),
           (8, None, "int-quantized")]


@pytest.mark.parametrize("bits,group_size,form", SCHEMES)
def test_each_layer_computes_with_the_dequantized_weight(tmp_path, float_checkpoint, bits, group_size, form) -> None:
    reference = write_compressed(float_checkpoint, tmp_path / "compressed", bits, group_size, form)
    model, config = load_model(tmp_path / "compressed", dtype="float32", attention=no_attention, tier=current_tier())
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    assert len(layers) == 4 * config.num_hidden_layers and not isinstance(model.lm_head, QuantizedLinear)
    assert_layers_compute_with(model, load_file(reference / "model.safetensors"), "int8" if bits == 8 else "int4")


@pytest.mark.parametrize("bits,group_size,form", SCHEMES[:1] + SCHEMES[2:3])
def test_the_engine_serves_the_dequantized_models_greedy_tokens(tmp_path, float_checkpoint, bits, group_size,
                                                                  form) -> None:
    reference = write_compressed(float_checkpoint, tmp_path / "compressed", bits, group_size, form)
    assert greedy_tokens(tmp_path / "compressed") == greedy_tokens(reference)


def test_a_w4a16_checkpoint_in_groups_of_32_holds_what_int4_at_load_makes(tmp_path, float_checkpoint) -> None:
    """The same scheme two ways, written by a quantizer or quantized by --quantization int4 at load: the decoder's
    layers hold the same integers and scales (the lm_head differs: the checkpoint leaves it float, int4 at load
    makes it int8)."""
    write_compressed(float_checkpoint, tmp_path / "compressed", 4, 32)
    read, _ = load_model(tmp_path / "compressed", dtype="float32", attention=no_attention, tier=current_tier())
    at_load, _ = load_model(float_checkpoint, dtype="float32", attention=no_attention, tier=current_tier(),
                            quantization="int4")
    made = dict(at_load.named_modules())
    layers = [(name, module) for name, module in read.named_modules() if isinstance(module, QuantizedLinear)]
    assert layers
    for name, layer in layers:
        twin = made[name]
        assert isinstance(twin, QuantizedLinear)
        assert torch.equal(layer.q, twin.q) and torch.equal(layer.scales, twin.scales), name


REFUSED = [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not served; pagedserve reads "
                                       "compressed-tensors, gptq, awq"),
    ({"format": "float-quantized"}, "format 'float-quantized' is not served"),
    ({"weights": {"symmetric": False}}, "asymmetric weights"),
    ({"weights": {"num_bits": 2}}, "2-bit weights"),
    ({"weights": {"strategy": "tensor"}}, "the 'tensor' strategy"),
    ({"input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}, "quantizes activations"),
    ({"second_group": True}, "2 config groups"),
]


@pytest.mark.parametrize("change,message", REFUSED)
def test_what_is_not_implemented_is_refused_at_load_by_name(tmp_path, float_checkpoint, change, message) -> None:
    write_compressed(float_checkpoint, tmp_path / "compressed", 4, 32)
    path = tmp_path / "compressed"
    quantization = json.loads((path / "config.json").read_text())["quantization_config"]
    group = quantization["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "weights":
            group["weights"].update(value)
        elif key == "input_activations":
            group[key] = value
        elif key == "second_group":
            quantization["config_groups"]["group_1"] = dict(group, targets=["re:.*down_proj"])
        else:
            quantization[key] = value
    set_quantization_config(path, quantization)
    with pytest.raises(CheckpointError, match=message):
        load_model(path, dtype="float32", attention=no_attention, tier=current_tier())


def test_quantizing_a_quantized_checkpoint_again_is_refused(tmp_path, float_checkpoint) -> None:
    write_compressed(float_checkpoint, tmp_path / "compressed", 8, None)
    with pytest.raises(CheckpointError, match="quantized already .*W8A16.*leave it out"):
        load_model(tmp_path / "compressed", dtype="float32", attention=no_attention, tier=current_tier(),
                   quantization="int4")


def test_a_missing_scale_names_the_tensor(tmp_path, float_checkpoint) -> None:
    write_compressed(float_checkpoint, tmp_path / "compressed", 4, 32)
    file = tmp_path / "compressed" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.down_proj.weight_scale'"):
        load_model(tmp_path / "compressed", dtype="float32", attention=no_attention, tier=current_tier())

