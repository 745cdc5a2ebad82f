"""Loading checkpoints: config spellings, dtype choice, and a CheckpointError naming the file for each bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gpu_worker.attention.torch_paged import paged_attention
from gpu_worker.models import CheckpointError, ModelConfig, load_model
from gpu_worker.models.config import read_model_config
from shared.cpu_tier import current_tier

from helpers.checkpoints import make_checkpoint
from helpers.paged_batches import make_metadata

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"single": make_checkpoint(root), "sharded": make_checkpoint(root, sharded=True)}


@pytest.fixture
def single(checkpoints, tmp_path):
    return shutil.copytree(checkpoints["single"], tmp_path / "single")


@pytest.fixture
def sharded(checkpoints, tmp_path):
    return shutil.copytree(checkpoints["sharded"], tmp_path / "sharded")


def load(path, dtype="auto"):
    return load_model(path, dtype=dtype, attention=paged_attention)


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def raises_naming(fragment: str):
    return pytest.raises(CheckpointError, match=fragment)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_missing_directory(tmp_path):
    with raises_naming("nowhere: checkpoint directory not found"):
        load(tmp_path / "nowhere")


def test_missing_config(single):
    (single / "config.json").unlink()
    with raises_naming(r"config\.json: file not found"):
        load(single)


def test_config_not_json(single):
    (single / "config.json").write_text("{not json")
    with raises_naming(r"config\.json: not valid JSON"):
        load(single)


def test_unsupported_architecture_names_the_supported_ones(single):
    edit_json(single / "config.json", architectures=["GPT2LMHeadModel"])
    with raises_naming(r"config\.json: unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load(single)


def test_missing_required_config_key(single):
    config = json.loads((single / "config.json").read_text())
    del config["hidden_size"]
    (single / "config.json").write_text(json.dumps(config))
    with raises_naming(r"config\.json: missing required key 'hidden_size'"):
        load(single)


def test_unsupported_checkpoint_dtype(single):
    edit_json(single / "config.json", dtype="float8_e4m3fn")
    with raises_naming(r"config\.json: dtype must be one of .*got 'float8_e4m3fn'"):
        load(single)


def test_unsupported_rope_type(single):
    edit_json(single / "config.json", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with raises_naming(r"config\.json: rope type must be one of .*got 'yarn'"):
        load(single)


def test_bad_head_counts(single):
    edit_json(single / "config.json", num_key_value_heads=3)
    with raises_naming(r"config\.json: num_attention_heads \(4\) must be a multiple of num_key_value_heads, got 3"):
        load(single)


def test_missing_safetensors(single):
    (single / "model.safetensors").unlink()
    with raises_naming(r"single: no model\.safetensors or model\.safetensors\.index\.json"):
        load(single)


def test_corrupt_safetensors(single):
    (single / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with raises_naming(r"model\.safetensors: not a readable safetensors file"):
        load(single)


def test_truncated_safetensors(single):
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) // 2])
    with raises_naming(r"model\.safetensors: not a readable safetensors file"):
        load(single)


def test_index_names_a_missing_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with raises_naming(rf"model\.safetensors\.index\.json: names shard '{shard.name}', which is missing"):
        load(sharded)


def test_tensor_missing_from_single_file(single):
    tensors = load_file(single / "model.safetensors")
    del tensors[Q_PROJ]
    save_file(tensors, single / "model.safetensors")
    with raises_naming(rf"model\.safetensors: missing 1 tensor\(s\) the model needs: {Q_PROJ}"):
        load(single)


def test_tensor_missing_from_index(sharded):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][Q_PROJ]
    index.write_text(json.dumps(data))
    with raises_naming(rf"index\.json: missing 1 tensor\(s\) the model needs: {Q_PROJ}"):
        load(sharded)


def test_index_points_at_shard_without_the_tensor(sharded):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    wrong_shard = next(shard for shard in data["weight_map"].values() if shard != data["weight_map"][Q_PROJ])
    data["weight_map"][Q_PROJ] = wrong_shard
    index.write_text(json.dumps(data))
    with raises_naming(rf"{wrong_shard}: missing tensor '{Q_PROJ}'"):
        load(sharded)


def test_tensor_with_wrong_shape(single):
    tensors = load_file(single / "model.safetensors")
    tensors[Q_PROJ] = torch.zeros(64, 32)
    save_file(tensors, single / "model.safetensors")
    with raises_naming(rf"model\.safetensors: tensor '{Q_PROJ}' has shape \[64, 32\], expected \[64, 64\]"):
        load(single)


def test_bad_dtype_argument(single):
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of .*got 'int8'"):
        load(single, dtype="int8")


def test_both_config_spellings_parse_alike(tmp_path):
    new = read_model_config(make_checkpoint(tmp_path, rope_scaling="llama3", rope_theta=500000.0))
    old = read_model_config(make_checkpoint(tmp_path, rope_scaling="llama3", rope_theta=500000.0, config_style="4.x"))
    assert new == old
    assert new.rope_theta == 500000.0
    assert new.rope_scaling["rope_type"] == "llama3" and new.rope_scaling["factor"] == 8.0
    plain = read_model_config(make_checkpoint(tmp_path, config_style="4.x"))
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0


def test_config_fields(tmp_path):
    config = read_model_config(make_checkpoint(tmp_path, "qwen2"))
    assert isinstance(config, ModelConfig)
    assert (config.architecture, config.num_key_value_heads, config.head_dim) == ("Qwen2ForCausalLM", 2, 16)
    assert config.attention_bias and not config.o_proj_bias and config.tie_word_embeddings
    assert (config.torch_dtype, config.bos_token_id, config.eos_token_ids) == (torch.float32, 1, (2,))


def test_eos_token_ids_union_config_and_generation_config(single):
    edit_json(single / "config.json", eos_token_id=[2, 5])
    edit_json(single / "generation_config.json", eos_token_id=[5, 9])
    assert read_model_config(single).eos_token_ids == (2, 5, 9)


def test_legacy_llama_without_head_dim_or_kv_heads(single):
    config = json.loads((single / "config.json").read_text())
    del config["head_dim"], config["num_key_value_heads"], config["dtype"]
    (single / "config.json").write_text(json.dumps(config))
    parsed = read_model_config(single)
    assert (parsed.head_dim, parsed.num_key_value_heads, parsed.torch_dtype) == (16, 4, torch.float32)


def test_bfloat16_checkpoint_loads_as_bfloat16_where_the_cpu_computes_it(tmp_path):
    """--dtype auto: bfloat16 on a CPU tier with native bfloat16, float32 below it (dtype_policy.py)."""
    path = make_checkpoint(tmp_path, dtype=torch.bfloat16, config_style="4.x")
    model, config = load(path)
    dtype = torch.bfloat16 if current_tier().has_native_bf16 else torch.float32
    assert config.torch_dtype == torch.bfloat16
    assert {param.dtype for param in model.parameters()} == {dtype}
    token_ids = list(range(3, 15))
    shape = (8, 4, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]
    meta = make_metadata([[5, 2, 7]], [0], [len(token_ids)], block_size=4)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), kv_caches, meta)
        logits = model.compute_logits(hidden)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    assert hidden.dtype == dtype and logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() < 0.5  # bf16 arithmetic on logits of std ~6


def test_dtype_override_upcasts_bfloat16_checkpoint(tmp_path):
    model, _ = load(make_checkpoint(tmp_path, dtype=torch.bfloat16), dtype=torch.float32)
    assert {param.dtype for param in model.parameters()} == {torch.float32}
