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
from dataclasses import dataclass

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
from gpu_worker.attention.metadata import AttentionMetadata  # noqa: E402

in_this_process = pytest.mark.skipif(RERUN_IN_FRESH_PROCESS, reason="triton loaded compiled on CPU; "
                                     "test_all_in_a_fresh_process runs this test")
DEVICE = "cuda" if ON_GPU else "cpu"
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
HALF_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
NUM_SPARE_BLOCKS = 3  # blocks no sequence owns: the kernels must never read or write them

# (cached tokens, new tokens) per sequence: a whole-prompt prefill, a chunk continuing a
# partly cached sequence, and decodes whose context ends inside, at and past block boundaries;
# the longest contexts need two steps of 64 keys, so the online softmax rescales.
MIXED = [(0, 7), (61, 6), (4, 1), (15, 1), (16, 1), (70, 1)]


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a view into a packed qkv tensor
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    context_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    context_v: list[torch.Tensor]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(specs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
               dtype=torch.float32, fill=float("nan"), seed=0) -> Batch:
    """A packed batch whose cached tokens are already in shuffled cache blocks.

    Free slots hold `fill` (NaN by default, so a kernel that lets one into its result fails).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in specs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + NUM_SPARE_BLOCKS
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(kv_shape, fill), torch.full(kv_shape, fill)

    num_tokens = sum(new for _, new in specs)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.view(num_tokens, num_heads, head_dim)  # [num_tokens, num_heads, head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)  # [num_tokens, num_kv_heads, head_dim]
    v = v.view(num_tokens, num_kv_heads, head_dim)

    context_k, context_v, slots, start = [], [], [], 0
    for (cached, new), table in zip(specs, tables):
        old_k = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(dtype)  # [cached, kv_heads, head_dim]
        old_v = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(cached):
            k_cache[table[pos // block_size], pos % block_size] = old_k[pos]
            v_cache[table[pos // block_size], pos % block_size] = old_v[pos]
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(cached, cached + new)]
        context_k.append(torch.cat([old_k, k[start:start + new].cpu()]))  # [seq_len, kv_heads, head_dim]
        context_v.append(torch.cat([old_v, v[start:start + new].cpu()]))
        start += new

    padded_tables = [t + [0] * (max(blocks_per_seq) - len(t)) for t in tables]
    query_lens = [new for _, new in specs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32,
                                     device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens),
    )
    return Batch(q, k, v, k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), meta, context_k, context_v)


def dense_causal_attention(batch: Batch, compute_dtype: torch.dtype) -> torch.Tensor:
    """One sequence at a time, all heads, the whole context: the slow reference, in compute_dtype."""
    num_heads, num_kv_heads = batch.q.shape[1], batch.k.shape[1]
    group = num_heads // num_kv_heads
    outs, start = [], 0
    for seq_len, new, ks, vs in zip(batch.meta.seq_lens_cpu, batch.meta.query_lens_cpu, batch.context_k,
                                    batch.context_v):
        q = batch.q[start:start + new].cpu().to(compute_dtype)  # [new, num_heads, head_dim]
        k = ks.to(compute_dtype).repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = vs.to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale  # [num_heads, new, seq_len]
        positions = torch.arange(seq_len - new, seq_len)[:, None]  # [new, 1]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > positions, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))  # [new, num_heads, head_dim]
        start += new
    return torch.cat(outs)  # [num_tokens, num_heads, head_dim]


def run_triton(batch: Batch) -> torch.Tensor:
    return triton_paged.paged_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                        batch.scale)


@in_this_process
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_mixed_batch_matches_dense_fp32(num_kv_heads, block_size):
    batch = make_batch(MIXED, num_kv_heads=num_kv_heads, block_size=block_size)
    out = run_triton(batch)
    torch.testing.assert_close(out.cpu().double(), dense_causal_attention(batch, torch.float64), **FP32_TOL)


@in_this_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_matches_dense_half(dtype):
    batch = make_batch(MIXED, num_kv_heads=2, block_size=4, dtype=dtype)
    out = run_triton(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), dense_causal_attention(batch, torch.float32), **HALF_TOL[dtype])


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
    torch.testing.assert_close(out.cpu().double(), dense_causal_attention(batch, torch.float64), **FP32_TOL)


@in_this_process
def test_prefill_spanning_several_query_tiles():
    # 16 rows / group 2 = 8 tokens per tile: the 20-token chunk needs three tiles, each with its own causal limit.
    batch = make_batch([(5, 20), (0, 9), (12, 1)], num_heads=4, num_kv_heads=2, block_size=4)
    triton_paged.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    tiles = triton_paged.AttentionTiles(block_m=16, block_n=16, num_warps=4)
    out = triton_paged.attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, tiles)
    torch.testing.assert_close(out.cpu().double(), dense_causal_attention(batch, torch.float64), **FP32_TOL)


@in_this_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_head_dim_and_group_of_eight(dtype):
    batch = make_batch([(0, 3), (6, 2), (18, 1)], num_heads=8, num_kv_heads=1, head_dim=128, dtype=dtype)
    out = run_triton(batch)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), dense_causal_attention(batch, torch.float64), **FP32_TOL)
    else:
        torch.testing.assert_close(out.cpu().float(), dense_causal_attention(batch, torch.float32), **HALF_TOL[dtype])


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
