"""AWQ checkpoints (AutoAWQ's GEMM layout): 4-bit weights with a zero point per group, read and served on the int4
kernel's zero-point format.

The tests write the checkpoints themselves from a tiny random float one,
with the format's packing spelled out here (write_awq): for each decoder
linear `P` of weight w [out, in] and each output column and group of
inputs, scale = (max - min) / 15, zero = round(-min / scale) in [0, 15],
q = round(w / scale) + zero in [0, 15]; `P.qweight` int32 [in, out / 8]
packs 8 outputs of an input into a word, 4 bits each from the low bits up,
in AWQ's order: nibble k of word j holds output 8j + (0, 2, 4, 6, 1, 3, 5,
7)[k]; `P.qzeros` int32 [groups, out / 8] packs the zero points the same way;
`P.scales` float16 [groups, out]. The reference is the float checkpoint of
(q - zero) x scale, written beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_outputs(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [rows, out] -> int32 [rows, out / 8] in AWQ's nibble order."""
    rows, out_features = values.shape
    ordered = values.view(rows, out_features // 8, 8)[..., AWQ_ORDER].reshape(rows, out_features)
    return pack_words(ordered, 4, dim=1)


def write_awq(source: Path, out: Path, group_size: int) -> Path:
    """An AWQ copy of `source` at `out` and, beside it, `out`-reference with the dequantized float weights."""

    def quantize_layer(layer: str, tensor: torch.Tensor) -> LayerTensors:
        out_features, in_features = tensor.shape
        groups = tensor.float().t().reshape(in_features // group_size, group_size, out_features)  # [groups, size, out]
        low, high = groups.amin(dim=1), groups.amax(dim=1)
        scale = ((high - low) / 15).half()  # [groups, out]
        zeros = torch.round(-low / scale.float()).clamp(0, 15).long()
        q = (torch.round(groups / scale.float().unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15).long()
        dequantized = ((q - zeros.unsqueeze(1)).float() * scale.float().unsqueeze(1)).reshape(
            in_features, out_features).t()
        return {f"{layer}.qweight": pack_outputs(q.reshape(in_features, out_features)),
                f"{layer}.qzeros": pack_outputs(zeros), f"{layer}.scales": scale}, dequantized

    return write_quantized_copy(source, out, quantize_layer, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None})


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("float"), "llama")


@pytest.mark.parametrize("group_size", [32, 64])
def test_each_layer_computes_with_the_dequantized_weight(tmp_path, float_checkpoint, group_size) -> None:
    reference = write_awq(float_checkpoint, tmp_path / "awq", group_size)
    model, config = load_model(tmp_path / "awq", dtype="float32", attention=no_attention, tier=current_tier())
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    assert len(layers) == 4 * config.num_hidden_layers and not isinstance(model.lm_head, QuantizedLinear)
    assert all(layer.group_size == group_size for layer in layers)
    assert_layers_compute_with(model, load_file(reference / "model.safetensors"), "int4")


def test_the_engine_serves_the_dequantized_models_greedy_tokens(tmp_path, float_checkpoint) -> None:
    reference = write_awq(float_checkpoint, tmp_path / "awq", 32)
    assert greedy_tokens(tmp_path / "awq") == greedy_tokens(reference)


REFUSED = [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"bits": 8}, "8-bit weights"),
    ({"zero_point": False}, "no zero points"),
]


@pytest.mark.parametrize("change,message", REFUSED)
def test_what_is_not_implemented_is_refused_at_load_by_name(tmp_path, float_checkpoint, change, message) -> None:
    write_awq(float_checkpoint, tmp_path / "awq", 32)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    set_quantization_config(tmp_path / "awq", {**config, **change})
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "awq", dtype="float32", attention=no_attention, tier=current_tier())
