"""Prompt logprobs from the Engine's prefill (in process), against transformers' log_softmax over the same prompt.

Each prompt token after the first gets log P(token | the prompt before it),
its rank and the k likeliest tokens, whether the prompt is prefilled in one
step or in chunks, next to a cached prefix, or recomputed after preemption;
no position is sent twice.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker.engine.engine import Engine
from shared.config import EngineConfig
from shared.logprobs import TokenLogprobs
from shared.sampling_params import SamplingParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def make_engine(checkpoint, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256,
                    max_num_batched_tokens=256, max_num_seqs=16, target_itl_ms=0)
    return Engine(EngineConfig(**{**settings, **overrides}))


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p - 1 is the distribution of the token at position p."""
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[TokenLogprobs]]:
    """Step the requests to their end; every prompt logprob entry each one was sent, in order, duplicates kept."""
    received: dict[str, list[TokenLogprobs]] = {request_id: [] for request_id in requests}
    expected_start = dict.fromkeys(requests, 1)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.prompt_logprobs is not None:
                assert out.prompt_logprobs_start == expected_start[out.request_id], "a gap or a repeat"
                expected_start[out.request_id] += len(out.prompt_logprobs)
                received[out.request_id].extend(out.prompt_logprobs)
    return received


def assert_matches_transformers(hf_model, prompt: list[int], entries: list[TokenLogprobs], k: int) -> None:
    reference = hf_logprobs(hf_model, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    for position, entry in enumerate(entries, start=1):
        row = reference[position - 1]
        expected = row[prompt[position]].item()
        assert entry.logprob == pytest.approx(expected, abs=TOLERANCE), f"position {position}"
        assert entry.rank == int((row > expected).sum()) + 1, f"position {position}"
        assert len(entry.top_token_ids) == k
        assert entry.top_logprobs == pytest.approx(row.topk(k).values.tolist(), abs=TOLERANCE)
        assert entry.top_logprobs == pytest.approx(row[entry.top_token_ids].tolist(), abs=TOLERANCE)


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(length)]


@pytest.mark.parametrize("max_num_batched_tokens", [256, 7], ids=["one-prefill", "chunks-of-7"])
def test_prompt_logprobs_match_transformers(checkpoint, hf_model, max_num_batched_tokens):
    engine = make_engine(checkpoint, max_num_batched_tokens=max_num_batched_tokens)
    rng = random.Random(1)
    vocab_size = engine.runner.model_config.vocab_size
    requests = {  # k of 0 and of 5 in one batch, next to a request that asks for none
        "k0": (random_prompt(rng, vocab_size, 41), SamplingParams(max_tokens=3, prompt_logprobs=0)),
        "k5": (random_prompt(rng, vocab_size, 23), SamplingParams(max_tokens=2, prompt_logprobs=5, logprobs=1)),
        "none": (random_prompt(rng, vocab_size, 30), SamplingParams(max_tokens=2)),
    }
    received = run(engine, requests)
    assert_matches_transformers(hf_model, requests["k0"][0], received["k0"], 0)
    assert_matches_transformers(hf_model, requests["k5"][0], received["k5"], 5)
    assert received["none"] == []


def test_a_cached_prefix_does_not_take_the_positions_away(checkpoint, hf_model):
    engine = make_engine(checkpoint)
    rng = random.Random(2)
    vocab_size = engine.runner.model_config.vocab_size
    prefix = random_prompt(rng, vocab_size, 40)
    blocks = engine.block_manager
    run(engine, {"warm": (prefix + random_prompt(rng, vocab_size, 5), SamplingParams(max_tokens=2))})
    hits_before = blocks.num_prefix_hit_tokens
    prompt = prefix + random_prompt(rng, vocab_size, 6)
    received = run(engine, {"scored": (prompt, SamplingParams(max_tokens=2, prompt_logprobs=2))})
    assert blocks.num_prefix_hit_tokens == hits_before, "a request owed prompt logprobs took blocks from the cache"
    assert_matches_transformers(hf_model, prompt, received["scored"], 2)
    run(engine, {"after": (prefix + random_prompt(rng, vocab_size, 7), SamplingParams(max_tokens=2))})
    assert blocks.num_prefix_hit_tokens >= hits_before + 40 - 40 % engine.config.block_size, \
        "the prefix was meant to be in the cache all along"


def test_preemption_sends_no_position_twice_and_loses_none(checkpoint, hf_model):
    engine = make_engine(checkpoint, num_kv_blocks=40, max_num_batched_tokens=16)
    rng = random.Random(3)
    vocab_size = engine.runner.model_config.vocab_size
    requests = {f"r{i}": (random_prompt(rng, vocab_size, rng.randint(2, 60)),
                          SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, prompt_logprobs=1))
                for i in range(14)}
    received = run(engine, requests)  # run() asserts each update starts where the last one ended
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    for request_id, (prompt, _) in requests.items():
        assert_matches_transformers(hf_model, prompt, received[request_id], 1)


def test_a_one_token_prompt_has_no_position_to_score_and_too_many_alternatives_are_refused(checkpoint):
    engine = make_engine(checkpoint)
    assert run(engine, {"short": ([5], SamplingParams(max_tokens=2, prompt_logprobs=3))}) == {"short": []}
    vocab_size = engine.runner.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("wide", [5, 6], SamplingParams(prompt_logprobs=vocab_size + 1))
    assert not engine.has_work()
