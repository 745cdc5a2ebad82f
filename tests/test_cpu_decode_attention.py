"""The C decode-attention kernel, each CPU tier's build, against the torch path and a dense float64 attention.

Tolerances: float32, 1e-5 absolute against both (the differences are
rounding in the softmax and the order of the sums). bfloat16 widened to
float32: the kernel accumulates in float32 and rounds once, so it stays
within one bfloat16 step (2^-8 relative) of the float64 result; against the
torch path, which rounds along the way, the torch path's own 3e-2.
bfloat16 by AVX-512 BF16 dot products, which also round the scaled query and
the probabilities to bfloat16: within one bfloat16 step of the torch path
run in float32 on the same bfloat16 values, plus BFLOAT16_DOT_FLOOR.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.attention import select_paged_attention, torch_paged
from gpu_worker.attention.cpu_decode import SOURCE, Bf16Path, CpuDecodeKernel, load_cpu_decode_kernel
from gpu_worker.native.compiled_library import load_kernel_library
from shared.cpu_tier import OVERRIDE_VARIABLE, CpuTier, best_tier, machine_flags

from helpers.cpu_tiers import kernel_tier_params
from helpers.dense_attention import BFLOAT16_TOLERANCE, FLOAT32_TOLERANCE, assert_close_to_reference, dense_reference
from helpers.paged_batches import PagedBatch as Batch
from helpers.paged_batches import make_paged_batch

REPO = Path(__file__).resolve().parent.parent
CONTEXTS = (1, 15, 16, 17, 1000)  # one token, around a block boundary (block_size 16), long
# Also odd ones (a tile whose last key has no partner in the dot products' key pairs) and ones that are not a
# multiple of 16 either side of several tiles; the last, longest, lends its first blocks to SHARING_CONTEXTS.
BFLOAT16_CONTEXTS = (1, 2, 3, 15, 16, 17, 31, 33, 255, 999, 2000)
SHARED_PREFIX = 32  # positions two more sequences read from the longest one's blocks: whole blocks of 8, 16 and 32
SHARING_CONTEXTS = (33, 100)
PREFILL = (20, 7)  # a prefill chunk (cached, new) in the middle of the batch, so decode rows are not sequence numbers
# The dot-product path rounds each probability (and the scaled query, which moves the scores) to bfloat16 before
# weighting the values: errors up to 2^-9 relative on terms as large as the values (standard normal here, up to
# about 4), which do not shrink where those terms cancel to an output near zero, whose own bfloat16 step is tiny.
# 2^-7 is one bfloat16 step at 1, half a step at 2-4; the worst seen past the step, over seeds 0-2 of these batches
# (block sizes 8/16/32, head_dim 64/128, groups 1 and 3), was 5.1e-3.
BFLOAT16_DOT_FLOOR = 2.0 ** -7


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request) -> CpuTier:
    """Each CPU tier this machine runs: every test of the kernel runs on each tier's build."""
    return request.param


@pytest.fixture(scope="module")
def kernel(tier) -> CpuDecodeKernel:
    built = load_cpu_decode_kernel(tier)
    assert built is not None, "the kernel is not installed; pip install -e . builds it"
    return built


def make_batch(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               seed: int = 0, contexts: tuple[int, ...] = CONTEXTS) -> Batch:
    """Decodes at every contexts length, two decodes sharing the longest (last) one's first blocks, one prefill."""
    steps = [(context - 1, 1) for context in contexts[:2]] + [PREFILL] + [(context - 1, 1) for context in contexts[2:]]
    steps += [(context - 1, 1) for context in SHARING_CONTEXTS]
    owner = steps.index((contexts[-1] - 1, 1))
    sharing = {seq: owner for seq in range(len(steps) - len(SHARING_CONTEXTS), len(steps))}
    return make_paged_batch(steps, block_size, num_heads, num_kv_heads, head_dim, dtype, sharing, SHARED_PREFIX, seed)


def decode_rows(batch: Batch) -> list[int]:
    """The rows of the batch's decodes (the rows the kernel computes; the prefill chunk's go to torch)."""
    starts = batch.meta.query_start_loc.tolist()
    return [start for start, end in zip(starts, starts[1:]) if end - start == 1]


def attend(batch: Batch, decode=None) -> torch.Tensor:
    return torch_paged.paged_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                       batch.scale, decode=decode)


def decode_directly(kernel: CpuDecodeKernel, batch: Batch, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, decodes: list[int]) -> torch.Tensor:
    """The kernel's decode_attention called as paged_attention calls it, on inputs paged_attention would not make."""
    out = torch.zeros_like(q)
    starts = batch.meta.query_start_loc.tolist()
    kernel.decode_attention(q, k_cache, v_cache, batch.meta, decodes, starts, batch.scale, out)
    return out


def decode_seqs(batch: Batch) -> list[int]:
    return [seq for seq, query_len in enumerate(batch.meta.query_lens_cpu) if query_len == 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_kernel_matches_dense_and_torch_path(kernel, block_size, num_heads, num_kv_heads, head_dim, dtype):
    batch = make_batch(block_size, num_heads, num_kv_heads, head_dim, dtype)
    assert kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    widening = kernel.with_widening()  # float32 ignores the bfloat16 path; the dot products have tests of their own
    out = attend(batch, decode=widening.decode_attention)
    reference = attend(batch)
    expected = dense_reference(batch)
    assert out.dtype == dtype and out.shape == expected.shape
    rows = decode_rows(batch)
    assert len(rows) == len(CONTEXTS) + len(SHARING_CONTEXTS)
    assert_close_to_reference(out[rows], expected[rows])
    tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else BFLOAT16_TOLERANCE
    diff = (out.double() - reference.double()).abs().max().item()
    assert diff < tolerance, f"kernel vs torch path: max abs diff {diff}"


# A work item takes as many of a sequence's kv heads as its 16 query heads hold, halved while that leaves fewer
# than 4 items a thread. So these decode counts and thread counts give items of all the kv heads, of several
# with a shorter last one (3 kv heads in items of 2 and 1), and of one each.
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (16, 8), (4, 4)])
@pytest.mark.parametrize("num_decodes", [1, 2, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_work_items_of_several_kv_heads_match_the_dense_reference(kernel, num_heads, num_kv_heads, num_decodes,
                                                                   threads):
    batch = make_batch(16, num_heads, num_kv_heads, 64, torch.float32)
    torch_paged.write_kv_cache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    decodes = decode_seqs(batch)[-num_decodes:]  # the longest contexts, and the two that share blocks
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_directly(kernel, batch, batch.q, batch.k_cache, batch.v_cache, decodes)
    finally:
        torch.set_num_threads(before)
    rows = [batch.meta.query_starts_cpu[seq] for seq in decodes]
    assert_close_to_reference(out[rows], dense_reference(batch)[rows])


def float32_reference(batch: Batch) -> torch.Tensor:
    """The torch path (gather + SDPA) in float32 on the batch's bfloat16 values, for its decode rows (others zero)."""
    q, k_cache, v_cache = (tensor.float() for tensor in (batch.q, batch.k_cache, batch.v_cache))
    out = torch.zeros_like(q)  # [num_tokens, num_heads, head_dim]
    torch_paged.decode_attention(q, k_cache, v_cache, batch.meta, decode_seqs(batch), batch.meta.query_starts_cpu,
                                 batch.scale, out)
    return out


def bfloat16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value of x: 2^(e - 8) for |x| in [2^(e - 1), 2^e); 0 at 0."""
    step = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)
    return torch.where(x == 0, 0.0, step)


def assert_within_a_bfloat16_step(out: torch.Tensor, reference: torch.Tensor) -> None:
    reference = reference.double()
    excess = (out.double() - reference).abs() - bfloat16_step(reference) - BFLOAT16_DOT_FLOOR
    assert excess.max().item() <= 0, f"off by more than one bfloat16 step plus the floor: max excess {excess.max()}"


def on_dot_products(kernel: CpuDecodeKernel) -> CpuDecodeKernel:
    """The kernel, which runs bfloat16 by dot products; a skip where the CPU lacks them (see the cpuinfo test)."""
    if kernel.compiled_bf16_path != Bf16Path.DOT_PRODUCTS:
        pytest.skip("the kernel was built for a CPU without AVX-512 BF16")
    return kernel


def decode_bfloat16_batch(kernel: CpuDecodeKernel, batch: Batch) -> torch.Tensor:
    """The kernel's output for the batch's decode rows, with the new tokens already in the cache; the prefill
    chunk's rows of out start as NaN and are checked to stay so: the kernel writes its decode rows only."""
    torch_paged.write_kv_cache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.q, torch.nan)  # [num_tokens, num_heads, head_dim]
    kernel.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, decode_seqs(batch),
                            batch.meta.query_starts_cpu, batch.scale, out)
    rows = decode_rows(batch)
    others = [row for row in range(out.shape[0]) if row not in rows]
    assert len(others) == PREFILL[1] and out[others].isnan().all(), "the kernel wrote rows that are not decodes"
    return out[rows]


@pytest.mark.parametrize("path", [Bf16Path.DOT_PRODUCTS, Bf16Path.WIDENING])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: a last dot-product chunk of 16 positions, not 32
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_bfloat16_paths_match_the_float32_torch_path(kernel, block_size, num_heads, num_kv_heads, head_dim, path):
    batch = make_batch(block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, contexts=BFLOAT16_CONTEXTS)
    on_path = on_dot_products(kernel) if path == Bf16Path.DOT_PRODUCTS else kernel.with_widening()
    assert on_path.bf16_path == path
    out = decode_bfloat16_batch(on_path, batch)
    assert out.dtype == torch.bfloat16
    assert_within_a_bfloat16_step(out, float32_reference(batch)[decode_rows(batch)])


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (16, 1, 256, 16),  # the largest group and head_dim the kernel takes
    (32, 2, 16, 5),  # the smallest head_dim: one half chunk; a block size that is no power of two
])
def test_dot_products_at_the_kernel_limits(kernel, num_heads, num_kv_heads, head_dim, block_size):
    batch = make_batch(block_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, contexts=BFLOAT16_CONTEXTS)
    assert kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    out = decode_bfloat16_batch(on_dot_products(kernel), batch)
    assert_within_a_bfloat16_step(out, float32_reference(batch)[decode_rows(batch)])


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (6, 2, 128)])
def test_dot_products_and_widening_agree(kernel, num_heads, num_kv_heads, head_dim):
    batch = make_batch(16, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=1, contexts=BFLOAT16_CONTEXTS)
    dot_products = decode_bfloat16_batch(on_dot_products(kernel), batch)
    widening = decode_bfloat16_batch(kernel.with_widening(), batch)
    assert_within_a_bfloat16_step(dot_products, widening)
    assert not torch.equal(dot_products, widening), "both calls ran the same path: the bfloat16 roundings left no trace"


LOAD = """
import logging
from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
logging.basicConfig(level=logging.INFO, format="%(message)s")
kernel = load_cpu_decode_kernel()
print(kernel.compiled_bf16_path.name, kernel.bf16_path.name, kernel.with_widening().bf16_path.name)
"""


@pytest.mark.parametrize("override", [None, *kernel_tier_params()])
def test_the_tier_chooses_the_bf16_path_and_the_load_says_so(override):
    """Dot products on a CPU with AVX-512 BF16, unless $PAGEDSERVE_CPU_ISA holds the process below it."""
    env = {key: value for key, value in os.environ.items() if key != OVERRIDE_VARIABLE}
    if override is not None:
        env[OVERRIDE_VARIABLE] = override.name
    tier = override or best_tier(platform.machine(), machine_flags())  # without an override: the CPU's own
    expected = Bf16Path.DOT_PRODUCTS if tier.has_native_bf16 else Bf16Path.WIDENING
    # A process of its own: a load here would replace the kernel every other test holds with a new one.
    loaded = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == [expected.name, expected.name, Bf16Path.WIDENING.name]
    lines = [line for line in loaded.stderr.splitlines() if line.startswith("bf16 decode")]
    assert lines == [f"bf16 decode attention: {expected.description}"], loaded.stderr


def test_only_the_avx512_bf16_build_runs_dot_products(tier, kernel):
    expected = Bf16Path.DOT_PRODUCTS if tier.has_native_bf16 else Bf16Path.WIDENING
    assert kernel.compiled_bf16_path == kernel.bf16_path == expected
    if expected == Bf16Path.WIDENING:
        with pytest.raises(ValueError, match="bf16_path should be WIDENING or this build's WIDENING, got DOT_PRODUCTS"):
            CpuDecodeKernel(load_kernel_library(SOURCE, tier), Bf16Path.DOT_PRODUCTS)


def test_select_paged_attention_on_cpu_uses_the_kernel_on_every_tier(tier):
    attention = select_paged_attention("cpu", tier)  # vectors as wide as the registers, or two SSE ones on x86-64
    assert attention.func is torch_paged.paged_attention
    assert attention.keywords["decode"] == load_cpu_decode_kernel().decode_attention  # "prefill": its own tests


def test_thread_count_does_not_change_the_result(kernel):
    batch = make_batch(16, 6, 2, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = attend(batch, decode=kernel.decode_attention)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, attend(batch, decode=kernel.decode_attention))


@pytest.mark.parametrize("dtype, head_dim, num_heads", [(torch.float16, 64, 6), (torch.float32, 4, 6),
                                                        (torch.float32, 64, 34)])
def test_inputs_past_the_kernel_go_to_the_torch_path(kernel, dtype, head_dim, num_heads):
    # float16, a head_dim that is not a multiple of any build's lanes (8 or 16), a group of 17 query heads per kv head
    batch = make_batch(16, num_heads, 2, head_dim, dtype)
    assert not kernel.accepts(batch.q, torch.empty_like(batch.q), batch.k_cache, batch.v_cache)
    assert torch.equal(attend(batch, decode=kernel.decode_attention), attend(batch))


@pytest.mark.parametrize("corrupt", ["block id", "seq_len", "query_start_loc past q", "query_start_loc below q"])
def test_bad_metadata_is_a_value_error(kernel, corrupt):
    batch = make_batch(16, 6, 2, 64, torch.float32)
    rows, too_long = batch.q.shape[0], batch.meta.block_tables.shape[1] * 16 + 1
    if corrupt == "block id":  # sequence 3 is a decode
        batch.meta.block_tables[3, 0] = batch.k_cache.shape[0]
        message = r"block id outside the cache in block_tables\[3\]$"
    elif corrupt == "seq_len":
        batch.meta.seq_lens[3] = too_long
        message = rf"seq_len outside 1\.\.block_table width \* block_size: seq_lens\[3\] = {too_long}$"
    else:
        bad_row = rows if corrupt == "query_start_loc past q" else -1
        batch.meta.query_start_loc[3] = bad_row
        message = rf"q of {rows} rows, .* a query row outside q: query_start_loc\[3\] = {bad_row}$"
    with pytest.raises(ValueError, match=message):
        attend(batch, decode=kernel.decode_attention)


@pytest.mark.parametrize("seq", [8, -1])
def test_a_seq_id_outside_the_metadata_is_a_value_error(kernel, seq):
    batch = make_batch(16, 6, 2, 64, torch.float32)  # 8 sequences
    with pytest.raises(ValueError, match=rf"8 sequences .*seq id past the metadata's sequences: {seq}$"):
        decode_directly(kernel, batch, batch.q, batch.k_cache, batch.v_cache, [*decode_seqs(batch), seq])


def test_metadata_tensors_of_different_lengths_are_a_value_error(kernel):
    batch = make_batch(16, 6, 2, 64, torch.float32)
    batch.meta.seq_lens = batch.meta.seq_lens[:-1]
    with pytest.raises(ValueError, match="metadata with 7 block table rows and 8 query_start_loc entries for 7 "
                                         "seq_lens, got 8 and 9"):
        decode_directly(kernel, batch, batch.q, batch.k_cache, batch.v_cache, decode_seqs(batch)[:-1])


@pytest.mark.parametrize("mismatch, message", [
    ("q head size", r"6 query heads of 64 for 2 kv heads of 128"),
    ("v_cache head size", r"shapes .* k_cache \(\d+, 16, 2, 128\), v_cache \(\d+, 16, 2, 64\)"),
    ("v_cache dtype", r"dtypes q torch.float32, out torch.float32, k_cache torch.float32, v_cache torch.bfloat16"),
    ("kv heads", r"6 query heads of 128 for 4 kv heads of 128"),
])
def test_inputs_that_disagree_are_a_value_error(kernel, mismatch, message):
    batch = make_batch(16, 6, 2, 128, torch.float32)
    q, k_cache, v_cache = batch.q, batch.k_cache, batch.v_cache
    if mismatch == "q head size":
        q = q[..., :64]
    elif mismatch == "v_cache head size":
        v_cache = v_cache[..., :64].contiguous()
    elif mismatch == "v_cache dtype":
        v_cache = v_cache.bfloat16()
    else:
        k_cache, v_cache = (cache.view(*cache.shape[:2], 4, 64).repeat_interleave(2, dim=3) for cache in (k_cache, v_cache))
    assert not kernel.accepts(q, torch.empty_like(q), k_cache, v_cache)
    with pytest.raises(ValueError, match=message):
        decode_directly(kernel, batch, q, k_cache, v_cache, decode_seqs(batch))
