"""The Triton paged attention kernels against a dense causal attention and the torch path.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1); with one, the same tests run them compiled on the GPU.
Tolerances (abs and rel): fp32 within 1e-5 of a float64 dense reference and of
the torch path; bf16 within 2e-2 and fp16 within 2e-3 of a fp32 dense reference
on the same rounded inputs (about 2x the error of rounding the reference itself).
"""

import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Triton chooses interpreted or compiled as each @triton.jit runs, its own library's included, so on
# CPU TRITON_INTERPRET=1 must be set before triton is first imported. When an earlier test module has
# already imported it (transformers does, through torch._dynamo), this file reruns in a fresh process.
RERUN_IN_FRESH_PROCESS = not ON_GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from gpu_worker.attention import torch_paged, triton_paged  # noqa: E402

from helpers.dense_attention import dense_reference  # noqa: E402
from helpers.paged_batches import PagedBatch, make_paged_batch  # noqa: E402

in_this_process = pytest.mark.skipif(RERUN_IN_FRESH_PROCESS, reason="triton loaded compiled on CPU; "
                                     "test_all_in_a_fresh_process runs this test")
DEVICE = "cuda" if ON_GPU else "cpu"
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
HALF_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# (cached tokens, new tokens) per sequence: a whole-prompt prefill, a chunk continuing a
# partly cached sequence, and decodes whose context ends inside, at and past block boundaries;
# the longest contexts need two steps of 64 keys, so the online softmax rescales.
MIXED = [(0, 7), (61, 6), (4, 1), (15, 1), (16, 1), (70, 1)]


def make_batch(steps: list[tuple[int, int]], num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
               block_size: int = 16, dtype: torch.dtype = torch.float32, fill: float = float("nan"),
               seed: int = 0) -> PagedBatch:
    """A packed batch on DEVICE whose cached tokens are already in shuffled cache blocks.

    Free slots hold `fill` (NaN by default, so a kernel that lets one into its result fails).
    """
    return make_paged_batch(steps, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=seed, fill=fill,
                            device=DEVICE)


def run_triton(batch: PagedBatch) -> torch.Tensor:
    return triton_paged.paged_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                        batch.scale)


@in_this_process
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_mixed_batch_matches_dense_fp32(num_kv_heads, block_size):
    batch = make_batch(MIXED, num_kv_heads=num_kv_heads, block_size=block_size)
    out = run_triton(batch)
    torch.testing.assert_close(out.cpu().double(), dense_reference(batch, torch.float64), **FP32_TOL)


@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_matches_dense_half(dtype):
    batch = make_batch(MIXED, num_kv_heads=2, block_size=4, dtype=dtype)
    out = run_triton(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), dense_reference(batch, torch.float32), **HALF_TOL[dtype])


@in_this_process
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_matches_torch_path(num_kv_heads):
    # Stale caches hold finite garbage, not NaN, as they would after earlier requests.
    batch = make_batch(MIXED, num_kv_heads=num_kv_heads, block_size=4, fill=123.0, seed=1)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    expected = torch_paged.paged_attention(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.scale)
    out = run_triton(batch)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    torch.testing.assert_close(batch.k_cache, k_cache, rtol=0, atol=0)
    torch.testing.assert_close(batch.v_cache, v_cache, rtol=0, atol=0)


@in_this_process
def test_store_kv_writes_exactly_the_new_slots():
    batch = make_batch(MIXED, num_kv_heads=2, block_size=4, fill=-7.0)
    before_k, before_v = batch.k_cache.clone(), batch.v_cache.clone()
    triton_paged.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    slots = batch.meta.slot_mapping
    for cache, before, new in ((batch.k_cache, before_k, batch.k), (batch.v_cache, before_v, batch.v)):
        flat, flat_before = cache.flatten(0, 1), before.flatten(0, 1)  # [num_blocks * block_size, kv_heads, dim]
        assert torch.equal(flat[slots], new)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert torch.equal(flat[untouched], flat_before[untouched])


@in_this_process
def test_decode_only_batch_uses_decode_tiles():
    specs = [(3, 1), (16, 1), (40, 1), (1, 1)]
    batch = make_batch(specs, num_heads=8, num_kv_heads=2, block_size=16)
    assert triton_paged.attention_tiles(32, 4, torch.float32, 1).block_m == triton_paged.DECODE_ROWS
    out = run_triton(batch)
    torch.testing.assert_close(out.cpu().double(), dense_reference(batch, torch.float64), **FP32_TOL)


@in_this_process
def test_prefill_spanning_several_query_tiles():
    # 16 rows / group 2 = 8 tokens per tile: the 20-token chunk needs three tiles, each with its own causal limit.
    batch = make_batch([(5, 20), (0, 9), (12, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    triton_paged.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    tiles = triton_paged.AttentionTiles(block_m=16, block_n=16, num_warps=4)
    out = triton_paged.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, tiles)
    torch.testing.assert_close(out.cpu().double(), dense_reference(batch, torch.float64), **FP32_TOL)


@in_this_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_head_dim_and_group_of_eight(dtype):
    batch = make_batch([(0, 3), (6, 2), (18, 1)], num_heads=8, num_kv_heads=1, head_dim=128, dtype=dtype)
    out = run_triton(batch)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), dense_reference(batch, torch.float64), **FP32_TOL)
    else:
        torch.testing.assert_close(out.cpu().float(), dense_reference(batch, torch.float32), **HALF_TOL[dtype])


@in_this_process
def test_rejects_head_dim_that_is_not_a_power_of_two():
    batch = make_batch([(0, 2)], head_dim=48)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        run_triton(batch)


if RERUN_IN_FRESH_PROCESS:
    def test_all_in_a_fresh_process():
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                                cwd=repo_root, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
