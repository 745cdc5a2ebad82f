"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum's format): 4-bit in groups or per channel, symmetric or with
zero points, 8-bit symmetric per channel, read and served.

The tests write the checkpoints themselves from a tiny random float one,
with the format's packing spelled out here (write_gptq): for each decoder
linear `P` of weight w [out, in], unsigned q = round(w / scale) + zero per
output column and group of inputs, symmetric with zero = 2^(bits-1) and
scale = max|w| / (2^(bits-1) - 1), or (sym false, 4 bits) scale =
(max - min) / 15 and zero = round(-min / scale) in [1, 15]; `P.qweight` int32 [in * bits / 32, out] packs 32 / bits
consecutive inputs of a column into a word, the first in the low bits;
`P.qzeros` int32 [groups, out * bits / 32] packs the zero points along the
outputs, stored as zero - 1 (format `gptq`, v1) or zero (`gptq_v2`);
`P.scales` float16 [groups, out]; `P.g_idx` int32 [in], each input's group.
The reference is the float checkpoint of (q - zero) x scale, written beside
it.
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
    pack_words,
    set_quantization_config,
    write_quantized_copy,
)


def write_gptq(source: Path, out: Path, bits: int, group_size: int, checkpoint_format: str = "gptq",
               sym: bool = True) -> Path:
    """A GPTQ copy of `source` at `out` and, beside it, `out`-reference with the dequantized float weights."""
    zero, largest = 2 ** (bits - 1), 2 ** (bits - 1) - 1

    def quantize_layer(layer: str, tensor: torch.Tensor) -> LayerTensors:
        out_features, in_features = tensor.shape
        size = in_features if group_size == -1 else group_size
        groups = tensor.float().t().reshape(in_features // size, size, out_features)  # [groups, size, out]
        if sym:
            scale = (groups.abs().amax(dim=1) / largest).half()  # [groups, out], as GPTQ stores it
            zeros = torch.full_like(scale, zero, dtype=torch.int64)
        else:  # the range's low end at zero points of 1..15 (v1 stores zero - 1, which must stay in 4 bits)
            low, high = groups.amin(dim=1), groups.amax(dim=1)
            scale = ((high - low) / (2 * zero - 1)).half()
            zeros = torch.round(-low / scale.float()).clamp(1, 2 * zero - 1).long()
        q = (torch.round(groups / scale.float().unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 2 * zero - 1).long()
        dequantized = ((q - zeros.unsqueeze(1)).float() * scale.float().unsqueeze(1)).reshape(
            in_features, out_features).t()
        return {f"{layer}.qweight": pack_words(q.reshape(in_features, out_features), bits, dim=0),
                f"{layer}.qzeros": pack_words(zeros - int(checkpoint_format == "gptq"), bits, dim=1),
                f"{layer}.scales": scale,
                f"{layer}.g_idx": (torch.arange(in_features) // size).to(torch.int32)}, dequantized

    return write_quantized_copy(source, out, quantize_layer, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": sym,
        "checkpoint_format": checkpoint_format})


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("float"), "llama")


SCHEMES = [(4, 32, "gptq", True), (4, -1, "gptq", True), (4, 32, "gptq_v2", True), (8, -1, "gptq", True),
           (4, 32, "gptq", False), (4, -1, "gptq_v2", False)]


@pytest.mark.parametrize("bits,group_size,checkpoint_format,sym", SCHEMES)
def test_each_layer_computes_with_the_dequantized_weight(tmp_path, float_checkpoint, bits, group_size,
                                                          checkpoint_format, sym) -> None:
    reference = write_gptq(float_checkpoint, tmp_path / "gptq", bits, group_size, checkpoint_format, sym)
    model, config = load_model(tmp_path / "gptq", dtype="float32", attention=no_attention, tier=current_tier())
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    assert len(layers) == 4 * config.num_hidden_layers and not isinstance(model.lm_head, QuantizedLinear)
    assert_layers_compute_with(model, load_file(reference / "model.safetensors"), "int8" if bits == 8 else "int4")


@pytest.mark.parametrize("sym", [True, False])
def test_the_engine_serves_the_dequantized_models_greedy_tokens(tmp_path, float_checkpoint, sym) -> None:
    reference = write_gptq(float_checkpoint, tmp_path / "gptq", 4, 32, sym=sym)
    assert greedy_tokens(tmp_path / "gptq") == greedy_tokens(reference)


REFUSED = [
    ({"bits": 8, "group_size": -1, "sym": False}, "8-bit asymmetric weights"),
    ({"desc_act": True}, "act-order"),
    ({"bits": 3}, "3-bit weights"),
    ({"bits": 8, "group_size": 32}, "8-bit weights in groups"),
    ({"lm_head": True}, "a quantized lm_head"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
]


@pytest.mark.parametrize("change,message", REFUSED)
def test_what_is_not_implemented_is_refused_at_load_by_name(tmp_path, float_checkpoint, change, message) -> None:
    write_gptq(float_checkpoint, tmp_path / "gptq", 4, 32)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    set_quantization_config(tmp_path / "gptq", {**config, **change})
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "gptq", dtype="float32", attention=no_attention, tier=current_tier())


@pytest.mark.parametrize("tensor,message", [("qzeros", "zero points other than 8"), ("g_idx", "act-order")])
def test_zero_points_and_group_orders_it_cannot_serve_are_found_in_the_tensors(tmp_path, float_checkpoint, tensor,
                                                                               message) -> None:
    """A config that says sym and no act-order is checked against the tensors themselves."""
    write_gptq(float_checkpoint, tmp_path / "gptq", 4, 32)
    file = tmp_path / "gptq" / "model.safetensors"
    tensors = load_file(file)
    name = f"model.layers.0.mlp.down_proj.{tensor}"
    if tensor == "qzeros":
        tensors[name] = tensors[name] + 1  # every eighth column's zero point 9 instead of 8
    else:
        tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "gptq", dtype="float32", attention=no_attention, tier=current_tier())

