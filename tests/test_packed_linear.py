"""PackedLinear (oneDNN packed weights) against F.linear, its reference, and what packing does to a loaded model:
float32 layers become TiledLinear (tests/test_cpu_linear.py) from AVX2 up, PackedLinear below."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gpu_worker.models import load_model
from gpu_worker.models.cpu_linear import TiledLinear
from gpu_worker.models.packed_linear import PackedLinear, pack_linears, pads_rows
from gpu_worker.process.memory_report import malloc_in_use_bytes
from shared.cpu_tier import current_tier, tier_named

from helpers.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear_to_rounding(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight, b = torch.randn(1152, 576), torch.randn(1152) if bias else None
    x = torch.randn(rows, 576)
    got = PackedLinear(weight, b)(x)
    reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
    # Sums of 576 products of unit normals: about 24 in size; float32 summation in any order stays within 1e-5 of it.
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-4)
    assert got.dtype == torch.float32 and got.shape == (rows, 1152)


@pytest.mark.skipif(not current_tier().can_pack_bf16, reason="oneDNN packs bfloat16 from AVX-512 up")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_bfloat16_is_bit_identical_to_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias, x = (torch.randn(shape).to(torch.bfloat16) for shape in ((512, 256), (512,), (rows, 256)))
    assert torch.equal(PackedLinear(weight, bias)(x), F.linear(x, weight, bias))


def test_takes_rows_that_are_a_view() -> None:
    weight, wide = torch.randn(64, 32), torch.randn(8, 64)
    x = wide[:, :32]  # not contiguous, as a split of a fused projection's output is
    assert torch.allclose(PackedLinear(weight, None)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(17, 64), (2, 150, 64), (2049, 64)])
def test_padded_rows_come_back_in_their_shape_and_values(shape: tuple[int, ...]) -> None:
    torch.manual_seed(shape[0])
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(shape)
    got = PackedLinear(weight, bias)(x)
    assert got.shape == (*shape[:-1], 96)
    assert torch.allclose(got.double(), F.linear(x.double(), weight.double(), bias.double()), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(malloc_in_use_bytes() is None, reason="needs glibc's mallinfo2")
def test_every_row_count_up_to_512_compiles_only_the_ladders_kernels() -> None:
    """oneDNN compiles and caches a kernel per row count (about 0.28 MB each, in two caches): 496 row counts
    unpadded would keep about 270 MB; the ladder's 40 rungs from 17 to 512 keep about 22."""
    linear = PackedLinear(torch.randn(48, 32), None)
    before = malloc_in_use_bytes()
    for rows in range(17, 513):
        linear(torch.randn(rows, 32))
    assert malloc_in_use_bytes() - before < 60 * 2**20


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_loaded_model_runs_only_packed_linears_and_keeps_its_logits(tmp_path, arch: str, tied: bool) -> None:
    path = make_checkpoint(tmp_path, arch, tie_word_embeddings=tied)
    model, config = load_model(path, dtype="float32", attention=_no_attention)
    assert not [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    packed = [module for module in model.modules() if isinstance(module, (PackedLinear, TiledLinear))]
    assert len(packed) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    stored = load_file(path / "model.safetensors")
    embedding = stored["model.embed_tokens.weight"].float()
    lm_head = embedding if tied else stored["lm_head.weight"].float()
    hidden = torch.randn(3, config.hidden_size)
    assert torch.allclose(model.compute_logits(hidden), F.linear(hidden, lm_head), rtol=1e-5, atol=1e-5)
    # A tied lm_head is packed from the embedding table, which stays as it is for the lookups.
    assert torch.equal(model.model.embed_tokens.weight, embedding)


def test_float32_goes_to_the_tiled_kernel_from_avx2_up_and_to_onednn_below() -> None:
    for name, expected in (("avx2", TiledLinear), ("avx512", TiledLinear), ("x86-64", PackedLinear)):
        model = nn.Sequential(nn.Linear(4, 4))
        assert pack_linears(model, tier_named(name)) == 1
        assert type(model[0]) is expected, name
        assert pads_rows(model) == (expected is PackedLinear), "only oneDNN's kernels need the row ladder"


@pytest.mark.skipif(not current_tier().can_pack_bf16, reason="oneDNN packs bfloat16 from AVX-512 up")
def test_only_cpu_weights_of_packed_dtypes_are_replaced() -> None:
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4).to(torch.float16),
                          nn.Sequential(nn.Linear(4, 2).to(torch.bfloat16)))
    unpackable = nn.Sequential(nn.Linear(4, 4).to(torch.float16))
    assert not pads_rows(model) and pack_linears(model, tier_named("avx512")) == 2 and pads_rows(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)
    assert isinstance(model[2][0], PackedLinear)
    assert pack_linears(unpackable, tier_named("avx512")) == 0 and not pads_rows(unpackable), "its rows need no ladder"


def test_bfloat16_weights_stay_unpacked_on_a_tier_below_avx512() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(model, tier_named("avx2")) == 1
    assert isinstance(model[0], TiledLinear) and type(model[1]) is nn.Linear


def _no_attention(*args, **kwargs):
    raise AssertionError("compute_logits runs no attention")
