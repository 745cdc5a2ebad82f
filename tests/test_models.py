"""Our Llama-family model over the paged KV cache against transformers, on the same tiny checkpoints.

Reference: AutoModelForCausalLM in float32 with eager attention, the whole
prompt in one forward. Ours runs the prompt in one prefill, in uneven chunks
across block boundaries, token by token, and packed with other sequences,
on a shuffled (non-contiguous) block table. Tolerance: 1e-4 max abs logit
difference in float32; in bfloat16 (weights, activations and KV cache) a
relative error ||ours - ref|| / ||ref|| under 2e-2 against the float32
reference, the range bf16 operands land in.

Ours runs on $PAGEDSERVE_TEST_DEVICE (tests/helpers/test_device.py): the
CPU by default, CUDA with its Triton kernels under tools/device/device_check.sh.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker.attention import select_paged_attention
from gpu_worker.models import load_model

from helpers.checkpoints import make_checkpoint
from helpers.paged_batches import make_metadata
from helpers.test_device import TEST_DEVICE

TOLERANCE = 1e-4
BF16_RELATIVE_TOLERANCE = 2e-2
BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT_LEN = 23

CASES = {
    "llama-gqa-untied-sharded": dict(arch="llama", sharded=True),
    "llama3-rope-4x-config": dict(arch="llama", rope_scaling="llama3", rope_theta=500000.0, config_style="4.x"),
    "mistral-4x-config": dict(arch="mistral", config_style="4.x", num_hidden_layers=3),
    "qwen2-bias-tied-sharded": dict(arch="qwen2", sharded=True, rope_theta=1000000.0),
}


class PagedModel:
    """Our model plus a block pool: the test's stand-in for the BlockManager and ModelRunner."""

    def __init__(self, path, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        attention = select_paged_attention(TEST_DEVICE)  # what a worker there runs: C kernels or Triton's
        self.model, self.config = load_model(path, dtype=dtype, device=torch.device(TEST_DEVICE), attention=attention)
        shape = (NUM_BLOCKS, BLOCK_SIZE, self.config.num_key_value_heads, self.config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=TEST_DEVICE),
                           torch.zeros(shape, dtype=dtype, device=TEST_DEVICE))
                          for _ in range(self.config.num_hidden_layers)]
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables: dict[str, list[int]] = {}

    def step(self, batch: list[tuple[str, list[int], int, int]]) -> list[torch.Tensor]:
        """batch: (sequence name, its token ids, num_computed, num_new) -> each one's float32 logits on the CPU,
        [num_new, vocab]."""
        tables = [self._grow(name, computed + new) for name, _, computed, new in batch]
        meta = make_metadata(tables, [computed for _, _, computed, _ in batch],
                             [new for _, _, _, new in batch], BLOCK_SIZE, device=TEST_DEVICE)
        input_ids = torch.tensor([t for _, ids, computed, new in batch for t in ids[computed:computed + new]],
                                 device=TEST_DEVICE)
        positions = torch.tensor([p for _, _, computed, new in batch for p in range(computed, computed + new)],
                                 device=TEST_DEVICE)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden_size]
            logits = self.model.compute_logits(hidden).float().cpu()  # [num_tokens, vocab_size]
        return list(logits.split([new for _, _, _, new in batch]))

    def _grow(self, name: str, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(name, [])
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free_blocks.pop())
        return table


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(checkpoint path, {prompt seed: (token ids, HF logits [len, vocab])})."""
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompts = {}
    for seed, length in ((0, PROMPT_LEN), (1, 11), (2, 17)):
        token_ids = prompt(length, seed)
        with torch.no_grad():
            prompts[seed] = token_ids, reference(torch.tensor([token_ids])).logits[0]
    return path, prompts


def assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff < TOLERANCE, f"max abs logit diff {diff}"


def test_one_prefill_matches_transformers(case):
    path, prompts = case
    token_ids, expected = prompts[0]
    (logits,) = PagedModel(path).step([("a", token_ids, 0, len(token_ids))])
    assert_close(logits, expected)


def test_chunked_prefill_matches_transformers(case):
    path, prompts = case
    token_ids, expected = prompts[0]
    paged, logits, computed = PagedModel(path), [], 0
    for chunk in (7, 10, 6):  # uneven, each crossing a block boundary
        logits += paged.step([("a", token_ids, computed, chunk)])
        computed += chunk
    assert_close(torch.cat(logits), expected)


def test_token_by_token_matches_transformers(case):
    path, prompts = case
    token_ids, expected = prompts[0]
    paged = PagedModel(path)
    logits = [paged.step([("a", token_ids, position, 1)])[0] for position in range(len(token_ids))]
    assert_close(torch.cat(logits), expected)


def test_packed_prefill_and_decodes_match_transformers(case):
    path, prompts = case
    (a, a_expected), (b, b_expected), (c, c_expected) = prompts[0], prompts[1], prompts[2]
    paged = PagedModel(path)
    b_first, c_first = paged.step([("b", b, 0, 10), ("c", c, 0, 16)])  # two prefills packed
    a_first, b_last, c_last = paged.step([("a", a, 0, 12), ("b", b, 10, 1), ("c", c, 16, 1)])  # prefill + decodes
    (a_rest,) = paged.step([("a", a, 12, len(a) - 12)])
    assert_close(torch.cat([a_first, a_rest]), a_expected)
    assert_close(torch.cat([b_first, b_last]), b_expected)
    assert_close(torch.cat([c_first, c_last]), c_expected)


def test_bf16_packed_prefill_and_decodes_match_transformers(case):
    """The same packed steps in bfloat16: weights, activations and the KV cache rounded, so a relative bound."""
    path, prompts = case
    (a, a_expected), (b, b_expected) = prompts[0], prompts[1]
    paged = PagedModel(path, dtype=torch.bfloat16)
    (b_first,) = paged.step([("b", b, 0, 10)])
    a_first, b_last = paged.step([("a", a, 0, 12), ("b", b, 10, 1)])  # a prefill packed with a decode
    (a_rest,) = paged.step([("a", a, 12, len(a) - 12)])
    for ours, expected in ((torch.cat([a_first, a_rest]), a_expected), (torch.cat([b_first, b_last]), b_expected)):
        error = ((ours - expected).norm() / expected.norm()).item()
        assert error < BF16_RELATIVE_TOLERANCE, f"relative logit error {error:.2e} in bfloat16"


def test_checkpoint_logits_are_decisive(case):
    """The sharpened checkpoints give greedy picks that no rounding difference can flip."""
    _, prompts = case
    _, logits = prompts[0]
    top2 = logits.topk(2, dim=-1).values  # [len, 2]
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3
    assert logits.std().item() > 1.0
