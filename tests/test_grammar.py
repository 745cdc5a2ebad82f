"""Structured output in the worker (gpu_worker/sampling/grammar.py): the mask in the sampler, the matcher in the engine.

A real Engine on a tiny random checkpoint with a real tokenizer and real llguidance grammars: every output is
checked against the grammar by an independent matcher (and, for JSON, by json.loads), the unconstrained output of
the same seeds is shown not to follow the grammar (so the mask, not luck, makes it valid), a resumed request
continues exactly as the uninterrupted one, and a grammar or output the worker cannot follow fails that request
alone.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.sampling import token_mask
from gpu_worker.sampling.grammar import GrammarError, Grammars, mask_disallowed
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.sequence import Sequence
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.vocabulary import TOKENIZER_FILE

from helpers.cpu_tiers import kernel_tier_params

EOS = 2
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["word", "count", "tags"], "additionalProperties": False}


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=512,
                               max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512))


@pytest.fixture(scope="module")
def llg_tokenizer(checkpoint) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(str(checkpoint / TOKENIZER_FILE))


def follows(llg_tokenizer: llguidance.LLTokenizer, grammar: str, token_ids: list[int], *, complete: bool) -> bool:
    """Whether `token_ids` (an EOS at the end aside) follow `grammar`, checked by a matcher of its own."""
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
    body = token_ids[:-1] if token_ids and token_ids[-1] == EOS else token_ids
    return matcher.consume_tokens(body) and (not complete or matcher.is_accepting())


def test_every_constrained_output_follows_the_schema_where_the_unconstrained_one_does_not(engine, llg_tokenizer):
    grammar = json_grammar(SCHEMA)
    prompts = [[1, 40 + i, 50 + i] for i in range(12)]
    constrained = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=grammar) for i in range(12)]
    free = [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(12)]
    tokenizer = llg_tokenizer
    for completion in generate(engine, prompts, constrained):
        assert completion.finish_reason == "stop" and follows(tokenizer, grammar, completion.token_ids, complete=True)
        value = json.loads(tokenizer.decode_str([t for t in completion.token_ids if t != EOS]))
        assert set(value) == {"word", "count", "tags"} and 0 <= value["count"] <= 50 and len(value["word"]) <= 6
    assert not any(follows(tokenizer, grammar, c.token_ids, complete=False) for c in generate(engine, prompts, free))


def test_greedy_and_sampled_rows_of_one_batch_each_follow_their_own_grammar(engine, llg_tokenizer):
    grammars = [llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2}"),
                llguidance.grammar_from("choice", json.dumps(["alpha", "beta", "gamma"])), None]
    params = [SamplingParams(max_tokens=30, temperature=t, seed=7, grammar=g) for g in grammars for t in (0.0, 1.0)]
    completions = generate(engine, [[1, 60, 61]] * len(params), params)
    for p, completion in zip(params, completions):
        if p.grammar is not None:
            assert completion.finish_reason == "stop"
            assert follows(llg_tokenizer, p.grammar, completion.token_ids, complete=True)
    texts = [llg_tokenizer.decode_str(c.token_ids) for c in completions[2:4]]
    assert all(text in ("alpha", "beta", "gamma") for text in texts)


def test_a_resumed_request_continues_exactly_as_the_uninterrupted_one(engine):
    grammar = json_grammar(SCHEMA)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=11, grammar=grammar)
    [whole] = generate(engine, [[1, 70, 71]], params)
    for cut in (1, 5, len(whole.token_ids) // 2):
        engine.add_request("resumed", [1, 70, 71], SamplingParams(max_tokens=120 - cut, temperature=1.0, seed=11,
                                                                  grammar=grammar),
                           output_token_ids=whole.token_ids[:cut])
        rest: list[int] = []
        while engine.has_work():
            for out in engine.step():
                rest.extend(out.new_token_ids.tolist())
        assert whole.token_ids[:cut] + rest == whole.token_ids, cut


def test_a_grammar_that_does_not_compile_or_an_output_that_breaks_it_is_refused_at_admission(engine):
    with pytest.raises(GrammarError, match="does not compile"):
        engine.add_request("bad", [1, 5], SamplingParams(grammar=llguidance.LLMatcher.grammar_from_regex("(abc")))
    regex = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
    with pytest.raises(GrammarError, match="does not follow"):
        engine.add_request("resumed-off-grammar", [1, 5], SamplingParams(grammar=regex), output_token_ids=[EOS, EOS])
    assert not engine.has_work()
    [done] = generate(engine, [[1, 5]], SamplingParams(max_tokens=4, grammar=regex))  # the engine is unharmed
    assert done.error is None and len(done.token_ids) == 4


def test_eos_is_allowed_only_where_the_grammar_may_end(checkpoint):
    grammars = Grammars(checkpoint / TOKENIZER_FILE, 512, (EOS,))
    logits = torch.zeros(2, 512)
    in_progress = grammars.state(llguidance.grammar_from("choice", json.dumps(["ab", "abab"])))
    open_ended = grammars.state(llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    for token in llguidance.LLTokenizer(str(checkpoint / TOKENIZER_FILE)).tokenize_str("7"):
        open_ended.advance(token)
    mask_disallowed(logits, [in_progress, open_ended])
    assert logits[0, EOS] == float("-inf") and logits[1, EOS] == 0.0
    assert (logits[1] == 0).sum() > 10  # more digits, or the end
    with pytest.raises(GrammarError, match="does not follow"):
        in_progress.advance(EOS)


def test_the_sampler_never_draws_a_masked_token_whatever_the_bias(checkpoint):
    grammars = Grammars(checkpoint / TOKENIZER_FILE, 512, (EOS,))
    regex = llguidance.LLMatcher.grammar_from_regex("x+")
    allowed = set()
    for seed in range(20):
        seq = Sequence("r", [1], SamplingParams(temperature=2.0, logit_bias={5: 100.0, EOS: 100.0}), seed=seed,
                       grammar=grammars.state(regex))
        token = Sampler((EOS,))(torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)), [seq]).token_ids[0]
        seq.append_output(token)  # raises if the grammar did not allow it
        allowed.add(token)
    assert 5 not in allowed and EOS not in allowed


@pytest.mark.parametrize("tier", kernel_tier_params())
@pytest.mark.parametrize("vocab_size", [32, 100, 49152 + 7])
def test_the_cpu_mask_kernel_matches_the_torch_reference(vocab_size, tier):
    kernel = token_mask.load_kernel(tier)
    assert kernel is not None, "the token mask kernel is not installed; pip install -e . builds it"
    generator = np.random.default_rng(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = generator.integers(-2**31, 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    bitmask[3, ::2] = -1  # whole words of each
    logits = torch.randn(8, vocab_size + 3)[:, :vocab_size]  # rows apart: a stride wider than the vocabulary
    rows = [6, 0, 3, 7, 2]
    expected, got = logits.clone(), logits.clone()
    token_mask.apply_with_torch(expected, rows, bitmask)
    token_mask.apply_on_cpu(kernel, got, rows, bitmask)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 1, 4, 5]], logits[[0, 1, 4, 5]])  # the all-allowed row (0) and the rows not named
    assert torch.isinf(got[3]).all()  # the row whose bitmask allows nothing


def test_a_tokenizer_larger_than_the_model_is_a_grammar_error_not_a_crash(checkpoint):
    grammars = Grammars(checkpoint / TOKENIZER_FILE, 100, (EOS,))  # 512 tokens, 100 rows of logits
    with pytest.raises(GrammarError, match="vocab size too small"):
        grammars.state(llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
