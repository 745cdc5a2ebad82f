"""GGUF files (llama.cpp's format) read and served: Q8_0 and Q4_0 linear layers on the int8 and int4 kernels, the
rest as float, and the tokenizer and chat template from the file's metadata.

The files are written by the tests (helpers/gguf_checkpoints.py spells out
the block packing and the converter's reordering of llama's q and k rows)
from tiny random checkpoints, sharpened so that greedy picks are decisive.
Two references: the float checkpoint of the dequantized weights written
beside each file (every quantized layer computes what its weight does), and
transformers reading the same file with its own GGUF loader (the same
greedy tokens and logits, which checks the names, the row order and the
block formats against an independent reader).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers

from gpu_worker.models import load_model
from gpu_worker.models.config import CheckpointError
from gpu_worker.models.quantized_linear import QuantizedLinear
from server.__main__ import build_parser, main, server_config_from_args
from shared.default_model import DEFAULT_MODEL_DIR
from shared.gguf_model.metadata import GGUF_FILE, GgufError
from shared.gguf_model.unpack import unpacked_dir

from helpers.checkpoints import make_checkpoint
from helpers.gguf_checkpoints import write_gguf
from helpers.quantized_checkpoints import MAX_TOKENS, PROMPT, greedy_tokens, no_attention

VOCAB = 4096  # the default model's tokenizer's, which the files carry
SCHEMES = {"Q8_0": "int8", "Q4_0": "int4"}
TEXTS = ["Hello there, said the old man.  It's 12345 o'clock!\n\nNew para", "KING HENRY:\nWhat say you?",
         "  spaces\tand tabs, émigrés and 日本語 </s> <s>", ""]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    """Unpacked directories under the test's own cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def gguf_file(tmp_path: Path, linear_type: str, arch: str = "llama", **options) -> tuple[Path, Path]:
    checkpoint = make_checkpoint(tmp_path, arch, vocab_size=VOCAB)
    return write_gguf(checkpoint, tmp_path / f"{arch}-{linear_type}.gguf", linear_type, architecture=arch,
                      tokenizer_dir=DEFAULT_MODEL_DIR, **options)


@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_linear_layer_computes_with_its_dequantized_weight(tmp_path, linear_type: str, arch: str):
    file, reference = gguf_file(tmp_path, linear_type, arch)
    model, _ = load_model(unpacked_dir(file), "float32", attention=no_attention)
    expected, _ = load_model(reference, "float32", attention=no_attention)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert len(layers) == 4 * 2 + (arch == "llama"), "every decoder linear, and an untied lm_head"
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    dequantized = dict(expected.named_modules())
    for name, layer in layers.items():
        assert (layer.scheme, layer.group_size) == (SCHEMES[linear_type], 32), name
        rows = x[:, :layer.in_features]
        assert torch.allclose(layer(rows), dequantized[name](rows), rtol=1e-5, atol=1e-5), name
    for name, tensor in expected.state_dict().items():
        if name in model.state_dict() and tensor.dtype.is_floating_point:
            assert torch.equal(model.state_dict()[name], tensor), f"{name}: the float tensors are copied as they are"


def hf_greedy(model) -> list[int]:
    """transformers' greedy tokens for PROMPT (as many as greedy_tokens gives), EOS ignored."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_0", "F32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_and_logits_match_transformers_reading_the_same_file(tmp_path, linear_type: str, arch: str):
    file, _ = gguf_file(tmp_path, linear_type, arch)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                               dtype=torch.float32).eval()
    assert greedy_tokens(unpacked_dir(file)) == hf_greedy(theirs)
    model, _ = load_model(unpacked_dir(file), "float32", attention=no_attention)
    ours = dict(model.named_modules())
    for name, module in theirs.named_modules():  # each linear layer, fused or not, against transformers' float one
        if isinstance(module, torch.nn.Linear) and name.endswith(("q_proj", "gate_proj", "down_proj", "lm_head")):
            fused = name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(1))
            got = ours[fused](x)[:, :module.out_features]
            assert torch.allclose(got, F.linear(x, module.weight, module.bias), rtol=1e-5, atol=1e-5), name


def test_a_tied_table_in_q8_0_feeds_the_int8_lm_head_and_float_embeddings(tmp_path):
    checkpoint = make_checkpoint(tmp_path, vocab_size=VOCAB, tie_word_embeddings=True)
    file, reference = write_gguf(checkpoint, tmp_path / "tied.gguf", "Q4_0", embedding_type="Q8_0",
                                 tokenizer_dir=DEFAULT_MODEL_DIR)
    model, _ = load_model(unpacked_dir(file), "float32", attention=no_attention)
    expected, _ = load_model(reference, "float32", attention=no_attention)
    assert torch.equal(model.model.embed_tokens.weight, expected.model.embed_tokens.weight)
    lm_head = model.lm_head
    assert isinstance(lm_head, QuantizedLinear) and (lm_head.scheme, lm_head.group_size) == ("int8", 32)
    x = torch.randn(4, lm_head.in_features, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(lm_head(x), F.linear(x, expected.model.embed_tokens.weight), rtol=1e-5, atol=1e-5)
    assert greedy_tokens(unpacked_dir(file)) == greedy_tokens(reference)


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    file, _ = gguf_file(tmp_path, "Q8_0")
    directory = unpacked_dir(file)
    ours = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    original = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == original.encode(text, add_special_tokens=False).ids, text
        assert [theirs.bos_token_id, *ids] == theirs(text)["input_ids"], text
        assert ours.decode(ids) == original.decode(ids)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    original_settings = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert {key: settings[key] for key in ("bos_token", "eos_token", "add_bos_token", "chat_template")} == \
        {key: original_settings[key] for key in ("bos_token", "eos_token", "add_bos_token", "chat_template")}
    assert (directory / GGUF_FILE).resolve() == file.resolve()
    assert unpacked_dir(file) == directory, "the second start finds the first one's directory"


def test_the_command_line_serves_a_gguf_path_from_its_unpacked_directory(tmp_path, cache_home):
    file, _ = gguf_file(tmp_path, "Q4_0")
    config = server_config_from_args(build_parser().parse_args([str(file)]))
    assert Path(config.engine.model).parent == cache_home / "pagedserve" / "gguf"
    assert config.served_model_names == (str(file),)


def test_quantizing_a_quantized_file_again_is_refused(tmp_path):
    file, _ = gguf_file(tmp_path, "Q8_0")
    with pytest.raises(CheckpointError, match="the GGUF file is quantized already; --quantization int4"):
        load_model(unpacked_dir(file), "float32", attention=no_attention, quantization="int4")


def test_a_float_file_can_be_quantized_at_load(tmp_path):
    file, _ = gguf_file(tmp_path, "F32")
    model, _ = load_model(unpacked_dir(file), "float32", attention=no_attention, quantization="int8")
    assert {module.scheme for module in model.modules() if isinstance(module, QuantizedLinear)} == {"int8"}


def _rewrite(source: Path, out: Path, **changes) -> Path:
    """A copy of a GGUF file with metadata fields replaced (value, type) or removed (None)."""
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, changes.pop("general.architecture", (architecture,))[0])
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or changes.get(key, 0) is None:
            continue
        value, kind = changes.pop(key, (field.contents(), field.types[0]))
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    for key, (value, kind) in ((key, change) for key, change in changes.items() if change is not None):
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


STRING = gguf.GGUFValueType.STRING


@pytest.mark.parametrize("changes,message", [
    ({"general.architecture": ("gemma",)}, "general.architecture 'gemma' is not served; GGUF files of llama, qwen2"),
    ({"tokenizer.ggml.model": ("llama", STRING)}, "tokenizer.ggml.model 'llama' is not served .* --tokenizer"),
    ({"tokenizer.ggml.pre": ("deepseek-coder", STRING)}, "tokenizer.ggml.pre 'deepseek-coder' is not served"),
    ({"llama.rope.scaling.type": ("yarn", STRING)}, "llama.rope.scaling.type is 'yarn'"),
    ({"llama.block_count": None}, "metadata lacks llama.block_count"),
], ids=["architecture", "sentencepiece", "pre-tokenizer", "rope-scaling", "no-block-count"])
def test_what_is_not_served_is_refused_by_name_before_any_worker_starts(tmp_path, capsys, changes: dict,
                                                                          message: str):
    file, _ = gguf_file(tmp_path, "Q8_0")
    changed = _rewrite(file, tmp_path / "changed.gguf", **changes)
    with pytest.raises(GgufError, match=message):
        unpacked_dir(changed)
    with pytest.raises(SystemExit) as exit_info:
        main([str(changed)])
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_a_file_that_is_not_gguf_inside_is_refused_naming_it(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GgufError, match=f"{broken}: not a readable GGUF file"):
        unpacked_dir(broken)
