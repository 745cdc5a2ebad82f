"""The Engine end to end on a tiny (sharpened) Llama checkpoint, against transformers' generate()."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker.engine.engine import REQUEST_FAILED, Engine
from gpu_worker.engine.generate import generate
from gpu_worker.engine.step_hooks import StepHooks
from gpu_worker.models.cpu_linear import TiledLinear
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def make_engine(checkpoint, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256,
                    max_num_batched_tokens=64, max_num_seqs=16)
    return Engine(EngineConfig(**{**settings, **overrides}))


def hf_greedy(hf_model, prompt: list[int], max_tokens: int, eos_token_id: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos_token_id,
                                pad_token_id=eos_token_id)
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, seed: int, vocab_size: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def run_to_completion(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]
                      ) -> dict[str, list[int]]:
    """Step the engine, adding each arrival batch at its step; return every request's output tokens."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids.tolist()
        assert_no_block_shared(engine)
        step += 1
    return tokens


def assert_no_block_shared(engine: Engine) -> None:
    seen = set()
    for seq in engine.scheduler.running + engine.scheduler.waiting:
        assert not seen & set(seq.block_table), f"{seq.request_id} shares a block with another sequence"
        seen |= set(seq.block_table)
    assert engine.block_manager.num_free_blocks + len(seen) == engine.block_manager.num_blocks


# None: the automatic latency target; 0: the token budget alone; 0.001 ms: every prefill at the minimum chunk.
@pytest.mark.parametrize("target_itl_ms", [None, 0, 0.001])
def test_greedy_batch_with_preemption_and_chunked_prefill_matches_transformers(checkpoint, hf_model, target_itl_ms):
    engine = make_engine(checkpoint, num_kv_blocks=40, max_num_batched_tokens=16, target_itl_ms=target_itl_ms)
    eos = engine.eos_token_ids[0]
    vocab_size = engine.runner.model_config.vocab_size
    prompts = random_prompts(26, seed=1, vocab_size=vocab_size)
    rng = random.Random(2)
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    arrivals: dict[int, list] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        step = 0 if i < 12 else rng.randint(1, 60)  # the rest arrive while the first ones decode
        arrivals.setdefault(step, []).append((f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0)))
    outputs = run_to_completion(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert outputs[f"r{i}"] == hf_greedy(hf_model, prompt, n, eos), f"request r{i} differs"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_independent_of_the_batch(checkpoint):
    engine = make_engine(checkpoint)
    vocab_size = engine.runner.model_config.vocab_size
    prompt = random_prompts(1, seed=3, vocab_size=vocab_size)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = generate(engine, [prompt], params)[0].token_ids
    others = random_prompts(7, seed=4, vocab_size=vocab_size)
    crowd = generate(engine, others[:3] + [prompt] + others[3:],
                     [SamplingParams(max_tokens=15, temperature=1.0)] * 3 + [params]
                     + [SamplingParams(max_tokens=25, temperature=0.7, seed=9)] * 4)
    assert crowd[3].token_ids == alone
    different_seed = generate(engine, [prompt], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95,
                                                               seed=4321, ignore_eos=True))[0].token_ids
    assert different_seed != alone


@pytest.mark.parametrize("k", [1, 7, 13])
def test_resumed_request_continues_the_uninterrupted_run(checkpoint, k):
    engine = make_engine(checkpoint)
    prompt = random_prompts(1, seed=5, vocab_size=engine.runner.model_config.vocab_size)[0]
    params = dict(temperature=1.0, top_k=50, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                  seed=77, ignore_eos=True, min_tokens=15)
    full = generate(engine, [prompt], SamplingParams(max_tokens=20, **params))[0].token_ids
    engine.add_request("resumed", prompt, SamplingParams(max_tokens=20 - k, **{**params, "min_tokens": 15 - k}),
                       output_token_ids=full[:k])
    rest = []
    while engine.has_work():
        rest += [t for out in engine.step() for t in out.new_token_ids.tolist()]
    assert full[:k] + rest == full


def test_blocks_return_to_the_pool_after_finish_abort_and_preempt(checkpoint):
    engine = make_engine(checkpoint, num_kv_blocks=30, max_num_batched_tokens=12)
    prompts = random_prompts(12, seed=6, vocab_size=engine.runner.model_config.vocab_size, max_len=30)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=i))
    finish_reasons = {}
    step = 0
    while engine.has_work():
        if step in (3, 9, 15):
            engine.abort(f"r{step // 3}")
        for out in engine.step():
            if out.is_finished:
                finish_reasons[out.request_id] = out.finish_reason
        assert_no_block_shared(engine)
        step += 1
    assert engine.scheduler.num_preemptions > 0
    assert sorted(finish_reasons) == sorted(f"r{i}" for i in range(12))
    assert [finish_reasons[f"r{i}"] for i in (1, 3, 5)] == ["abort"] * 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(engine.block_manager.ref_count(b) == 0 for b in range(engine.block_manager.num_blocks))


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(checkpoint):
    engine = make_engine(checkpoint, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        engine.add_request("long", [5] * 64, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="token ids in"):
        engine.add_request("oov", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("ok", [5], SamplingParams())
    outputs = [out for _ in range(10) for out in engine.step()]
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "ok") == 3
    assert not engine.has_work()


def unchecked(params: SamplingParams, **fields) -> SamplingParams:
    """`params` with fields set after construction, past the checks a frontend would make."""
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def test_a_request_that_raises_fails_alone_and_its_batch_runs_on(checkpoint):
    engine = make_engine(checkpoint, num_kv_blocks=64)
    vocab_size = engine.runner.model_config.vocab_size
    prompts = random_prompts(5, seed=8, vocab_size=vocab_size, max_len=20)
    healthy = {"greedy-a": (prompts[0], SamplingParams(max_tokens=12, temperature=0)),
               "sampled": (prompts[1], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3)),
               "greedy-b": (prompts[2], SamplingParams(max_tokens=12, temperature=0, logprobs=2))}
    failing = {  # asks for more top logprobs than the vocab holds: sampling raises
               "fails-sampling": (prompts[3], unchecked(SamplingParams(max_tokens=12, temperature=0.5),
                                                        logprobs=vocab_size + 1)),
               # a stop list that is no list: updating the request after its first token raises
               "fails-update": (prompts[4], unchecked(SamplingParams(max_tokens=12), stop_token_ids=None))}
    alone = {rid: generate(engine, [prompt], params)[0] for rid, (prompt, params) in healthy.items()}

    for request_id, (prompt, params) in {**healthy, **failing}.items():
        engine.add_request(request_id, prompt, params)
    results = {request_id: [] for request_id in {**healthy, **failing}}
    while engine.has_work():
        for out in engine.step():
            results[out.request_id].append(out)
        assert_no_block_shared(engine)

    for request_id, completion in alone.items():
        outs = results[request_id]
        assert [t for out in outs for t in out.new_token_ids.tolist()] == completion.token_ids, request_id
        assert outs[-1].finish_reason == completion.finish_reason and all(out.error is None for out in outs)
        if completion.logprobs is not None:
            logprobs = [lp for out in outs for lp in out.logprobs]
            assert [lp.top_token_ids for lp in logprobs] == [lp.top_token_ids for lp in completion.logprobs]
            assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in completion.logprobs], abs=1e-4)
    for request_id in failing:
        [out] = results[request_id]
        assert len(out.new_token_ids) == 0 and out.finish_reason is None and out.is_finished
        assert out.error == REQUEST_FAILED and request_id not in out.error
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_device_error_while_sampling_fails_the_step_not_the_request(checkpoint):
    """Out of memory (or a broken accelerator) is the device's fault: the step raises, so the worker dies and the
    supervisor re-runs its requests on a new one, rather than failing them here for good."""
    def failing_device(sample):
        def out_of_memory_on_sampled_rows(logits, seqs, argmax):
            if any(not seq.sampling_params.is_greedy for seq in seqs):
                raise torch.OutOfMemoryError("out of memory while sampling")
            return sample(logits, seqs, argmax)
        return out_of_memory_on_sampled_rows  # the real sampler, with the device failing under it

    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=64,
                                 max_num_batched_tokens=64, max_num_seqs=16), StepHooks(sample=failing_device))
    engine.warm_up()  # greedy: the hooks are armed after it
    engine.add_request("greedy", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("sampled", [8, 9], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()


def test_a_decode_steps_inputs_are_the_packed_steps_tensors(checkpoint):
    """prepare_decodes, the runner's path for steps of one new token per sequence, gives the very tensors and
    metadata of prepare_packed, the path of any step: sequences of different lengths, crossing block edges."""
    engine = make_engine(checkpoint)
    vocab_size = engine.runner.model_config.vocab_size
    for index, prompt in enumerate(random_prompts(6, seed=11, vocab_size=vocab_size, max_len=40)):
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    compared = 0
    for _ in range(25):
        scheduled = engine.schedule()
        if all(item.num_new_tokens == 1 for item in scheduled.scheduled):
            decodes, packed = (engine.runner.prepare_decodes(scheduled.scheduled),
                               engine.runner.prepare_packed(scheduled.scheduled))
            for got, expected in zip((*decodes[:2], decodes[3]), (*packed[:2], packed[3])):
                assert got.dtype == expected.dtype and torch.equal(got, expected)
            for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
                got, expected = getattr(decodes[2], name), getattr(packed[2], name)
                assert got.dtype == expected.dtype and torch.equal(got, expected), name
            for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu", "decode_seqs"):
                assert getattr(decodes[2], name) == getattr(packed[2], name), name
            compared += 1
        engine.run(scheduled)
    assert compared > 15


def test_steps_in_the_serving_context_run_as_steps_on_their_own(checkpoint, hf_model):
    """Engine.serving() holds inference mode over a loop of steps (the worker loop's whole life), where the runner
    otherwise enters it for each forward pass itself: the same tokens either way, transformers' tokens, and every
    forward pass in inference mode."""
    in_inference_mode: list[bool] = []

    def note_mode(execute, _block_manager):
        def noted(scheduled):
            step = execute(scheduled)
            in_inference_mode.append(step.logits.is_inference())
            return step
        return noted

    prompts = random_prompts(5, seed=12, vocab_size=hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0)
    outputs = {}
    for held in (False, True):
        engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256,
                                     max_num_batched_tokens=64, max_num_seqs=16), StepHooks(execute=note_mode))
        engine.warm_up()
        with engine.serving() if held else contextlib.nullcontext():
            outputs[held] = [result.token_ids for result in generate(engine, prompts, params)]
        assert torch.is_inference_mode_enabled() is False
    assert outputs[True] == outputs[False]
    eos = engine.eos_token_ids[0]
    assert outputs[True] == [hf_greedy(hf_model, prompt, 12, eos) for prompt in prompts]
    assert len(in_inference_mode) > 10 and all(in_inference_mode)


def test_a_plain_greedy_steps_argmax_comes_with_its_logits(checkpoint):
    """A step whose every sampling sequence is plain greedy has each row's argmax from the LM head's kernel
    (StepLogits.argmax), torch's argmax of the very logits, on a tier whose LM head is the tiled kernel (below AVX2,
    oneDNN's, none: the sampler takes it); a step with a sampled row has none, and its rows are drawn."""
    engine = make_engine(checkpoint)
    if not isinstance(engine.runner.model.lm_head, TiledLinear | PairTiledLinear):
        pytest.skip(f"on {engine.runner.cpu_tier.name} the LM head is oneDNN's, which takes no argmax")
    vocab_size = engine.runner.model_config.vocab_size
    for index, prompt in enumerate(random_prompts(4, seed=13, vocab_size=vocab_size, max_len=20)):
        engine.add_request(f"greedy-{index}", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    with_argmax = 0
    while engine.has_work():
        scheduled = engine.schedule()
        step = engine.runner.execute(scheduled)
        if step.logits.shape[0]:
            assert step.argmax is not None and torch.equal(step.argmax, step.logits.argmax(dim=-1))
            with_argmax += 1
        engine.run(scheduled)
    assert with_argmax >= 5
    engine.add_request("sampled", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    scheduled = engine.schedule()
    assert engine.runner.execute(scheduled).argmax is None
