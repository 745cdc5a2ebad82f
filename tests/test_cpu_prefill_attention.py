"""The C prefill-attention kernel against the torch path (gather + SDPA); its fallback and its checks of the metadata.

Tolerances: float32, 1e-5 absolute against the torch path (the differences
are rounding in the softmax and the order of the sums). bfloat16: the kernel
multiplies bfloat16 values exactly, accumulates in float32 and rounds once,
so it stays within one bfloat16 step (2^-8 relative, plus the float32
tolerance) of the torch path run in float32 on the same bfloat16 values.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_worker.attention import select_paged_attention, torch_paged
from gpu_worker.attention.cpu_decode import CpuDecodeKernel, load_cpu_decode_kernel
from gpu_worker.attention.cpu_prefill import SOURCE, CpuPrefillKernel, load_cpu_prefill_kernel
from gpu_worker.native.compiled_library import build_key, default_compiler

from helpers.cpu_tiers import kernel_tier_params
from helpers.dense_attention import assert_close_to_reference
from helpers.paged_batches import PagedBatch as Batch
from helpers.paged_batches import make_paged_batch

SHARED_PREFIX = 32  # positions shared with an earlier sequence's blocks: whole blocks of 8, 16 and 32
# (cached tokens, new tokens) per sequence: whole prompts, chunks over short and long cached contexts,
# one-token prompts and decodes (rows for the decode kernel) in between, lengths off every tile size.
STEPS = [(0, 47), (0, 1), (200, 33), (999, 1), (1000, 50), (40, 21), (32, 5), (15, 2), (0, 97)]
SHARING = {5: 4, 6: 4}  # sequence -> the sequence whose first SHARED_PREFIX positions (blocks) it reads


@pytest.fixture(scope="module", params=kernel_tier_params())
def kernel(request) -> CpuPrefillKernel:
    """The kernel's build for each CPU tier this machine runs (each tested against the same references)."""
    built = load_cpu_prefill_kernel(request.param)
    assert built is not None, "the kernel is not installed; pip install -e . builds it"
    return built


@pytest.fixture(scope="module")
def decode_kernel() -> CpuDecodeKernel:
    built = load_cpu_decode_kernel()
    assert built is not None, "the decode kernel did not build"
    return built


def make_batch(steps: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, sharing: dict[int, int] | None = None, seed: int = 0) -> Batch:
    """Each sequence's cached tokens in shuffled blocks (shared ones for `sharing`); garbage in the rest of the cache."""
    return make_paged_batch(steps, block_size, num_heads, num_kv_heads, head_dim, dtype, sharing, SHARED_PREFIX, seed)


def attend(batch: Batch, prefill=None, decode=None) -> torch.Tensor:
    return torch_paged.paged_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                       batch.scale, decode=decode, prefill=prefill)


def prefill_directly(kernel: CpuPrefillKernel, batch: Batch, prefills: list[int] | None = None) -> torch.Tensor:
    """The kernel's prefill_attention called as paged_attention calls it (the caches hold the new k/v already)."""
    out = torch.zeros_like(batch.q)
    kernel.prefill_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                             batch.prefills if prefills is None else prefills, batch.meta.query_starts_cpu,
                             batch.scale, out)
    return out


def prefill_rows(batch: Batch) -> list[int]:
    starts = batch.meta.query_starts_cpu
    return [row for seq in batch.prefills for row in range(starts[seq], starts[seq + 1])]


def assert_matches_torch_path(out: torch.Tensor, batch: Batch) -> None:
    """out's prefill rows against the torch path, run in float32 on batch's values."""
    expected = attend(batch.as_float32())[prefill_rows(batch)].double()
    assert_close_to_reference(out[prefill_rows(batch)], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_kernel_matches_the_torch_path(kernel, decode_kernel, block_size, num_heads, num_kv_heads, head_dim, dtype):
    batch = make_batch(STEPS, block_size, num_heads, num_kv_heads, head_dim, dtype, SHARING)
    assert kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    out = attend(batch, prefill=kernel.prefill_attention, decode=decode_kernel.decode_attention)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert_matches_torch_path(out, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts(kernel, dtype):
    batch = make_batch([(0, 2000), (1900, 100), (1000, 1000)], 16, 9, 3, 64, dtype)
    assert_matches_torch_path(attend(batch, prefill=kernel.prefill_attention), batch)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (16, 1)])
def test_every_query_length_around_a_work_item(kernel, num_heads, num_kv_heads):
    # A work item holds 48 query rows: 48 positions of one head, 16 of a group of 3, 3 of a group of 16.
    steps = [(cached, new) for new in range(2, 52) for cached in (0, 17)]
    batch = make_batch(steps, 16, num_heads, num_kv_heads, 64, torch.float32)
    assert_matches_torch_path(attend(batch, prefill=kernel.prefill_attention), batch)


def test_prefill_rows_go_to_the_prefill_kernel_and_decode_rows_to_the_decode_kernel(kernel, decode_kernel):
    batch = make_batch(STEPS, 16, 6, 2, 64, torch.float32, SHARING)
    calls = {}

    def prefill(*args) -> None:
        calls["prefill"] = list(args[6])
        kernel.prefill_attention(*args)

    def decode(*args) -> None:
        calls["decode"] = list(args[4])
        decode_kernel.decode_attention(*args)

    out = attend(batch, prefill=prefill, decode=decode)
    assert calls == {"prefill": [0, 2, 4, 5, 6, 7, 8], "decode": [1, 3]}
    assert_matches_torch_path(out, batch)


def test_thread_count_does_not_change_the_result(kernel):
    batch = make_batch(STEPS, 16, 6, 2, 64, torch.float32, SHARING)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = prefill_directly(kernel, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, prefill_directly(kernel, batch))


@pytest.mark.parametrize("dtype, head_dim, num_heads", [(torch.float16, 64, 6), (torch.float32, 4, 6),
                                                        (torch.float32, 64, 34)])
def test_inputs_past_the_kernel_go_to_the_torch_path(kernel, dtype, head_dim, num_heads):
    # float16, a head_dim that is not a multiple of any build's lanes (8 or 16), a group of 17 query heads per kv head
    batch = make_batch(STEPS, 16, num_heads, 2, head_dim, dtype, SHARING)
    assert not kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    assert torch.equal(attend(batch, prefill=kernel.prefill_attention), attend(batch))


@pytest.mark.parametrize("corrupt, message", [
    ("block id past the cache", r"block id outside the cache in block_tables\[4\]$"),
    ("negative block id", r"block id outside the cache in block_tables\[4\]$"),
    ("seq_len past the block table", r"seq_len outside query_len\.\.block_table width \* block_size: seq_lens\[2\] = 1057$"),
    ("seq_len below query_len", r"seq_len outside query_len\.\.block_table width \* block_size: seq_lens\[2\] = 32$"),
    ("query_start_loc past q", r"q of 257 rows, .* outside q \(or none\): query_start_loc\[8\], \[9\] = \[160, 258\]$"),
    ("query_start_loc below q", r"query rows outside q \(or none\): query_start_loc\[0\], \[1\] = \[-1, 47\]$"),
    ("no query rows", r"query rows outside q \(or none\): query_start_loc\[2\], \[3\] = \[82, 81\]$"),
])
def test_bad_metadata_is_a_value_error(kernel, corrupt, message):
    batch = make_batch(STEPS, 16, 6, 2, 64, torch.float32, SHARING)  # 257 rows, 9 sequences, tables of 66 blocks
    tables, seq_lens, starts = batch.meta.block_tables, batch.meta.seq_lens, batch.meta.query_start_loc
    if corrupt == "block id past the cache":
        tables[4, 65] = batch.k_cache.shape[0]  # sequence 4's last block, read only by its last rows
    elif corrupt == "negative block id":
        tables[4, 0] = -1
    elif corrupt == "seq_len past the block table":
        seq_lens[2] = tables.shape[1] * 16 + 1
    elif corrupt == "seq_len below query_len":
        seq_lens[2] = 32  # 33 new tokens
    elif corrupt == "query_start_loc past q":
        starts[9] = batch.q.shape[0] + 1
    elif corrupt == "query_start_loc below q":
        starts[0] = -1
    else:
        starts[2] = starts[3] + 1
    with pytest.raises(ValueError, match=message):
        prefill_directly(kernel, batch)


@pytest.mark.parametrize("seq", [9, -1])
def test_a_seq_id_outside_the_metadata_is_a_value_error(kernel, seq):
    batch = make_batch(STEPS, 16, 6, 2, 64, torch.float32, SHARING)  # 9 sequences
    with pytest.raises(ValueError, match=rf"9 sequences .*seq id past the metadata's sequences: {seq}$"):
        prefill_directly(kernel, batch, [*batch.prefills, seq])


def test_metadata_tensors_of_different_lengths_are_a_value_error(kernel):
    batch = make_batch(STEPS, 16, 6, 2, 64, torch.float32, SHARING)
    batch.meta.seq_lens = batch.meta.seq_lens[:-1]
    with pytest.raises(ValueError, match="metadata with 8 block table rows and 9 query_start_loc entries for 8 "
                                         "seq_lens, got 9 and 10"):
        prefill_directly(kernel, batch, batch.prefills[:-1])


@pytest.mark.parametrize("mismatch, message", [
    ("q head size", r"6 query heads of 64 for 2 kv heads of 128"),
    ("v_cache head size", r"shapes .* k_cache \(\d+, 16, 2, 128\), v_cache \(\d+, 16, 2, 64\)"),
    ("v_cache dtype", r"dtypes q torch.float32, out torch.float32, k_cache torch.float32, v_cache torch.bfloat16"),
])
def test_inputs_that_disagree_are_a_value_error(kernel, mismatch, message):
    batch = make_batch(STEPS, 16, 6, 2, 128, torch.float32, SHARING)
    if mismatch == "q head size":
        batch.q = batch.q[..., :64]
    elif mismatch == "v_cache head size":
        batch.v_cache = batch.v_cache[..., :64].contiguous()
    else:
        batch.v_cache = batch.v_cache.bfloat16()
    assert not kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match=message):
        prefill_directly(kernel, batch)


@pytest.mark.parametrize("tier", kernel_tier_params())
def test_select_paged_attention_on_cpu_uses_the_prefill_kernel_from_avx2_up(tier):
    attention = select_paged_attention("cpu", tier)
    assert attention.func is torch_paged.paged_attention
    if tier.vector_bits < 256:  # the kernel's 8-float vectors in two SSE registers: slower than the torch path
        assert "prefill" not in attention.keywords
    else:
        assert attention.keywords["prefill"] == load_cpu_prefill_kernel().prefill_attention


def test_an_edited_header_builds_a_new_library(tmp_path):
    for path in (SOURCE, *SOURCE.parent.glob("*.h")):
        shutil.copy(path, tmp_path / path.name)
    source = tmp_path / SOURCE.name
    before = build_key(source, default_compiler())
    header = tmp_path / "vector_math.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert build_key(source, default_compiler()) != before
