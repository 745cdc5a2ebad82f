"""Sampler: real tensors, real Sequences, no mocks.

Filters are checked against a plain-Python reference; the draw's noise against
a per-element Python hash; the temperature draw's empirical distribution
against softmax(logits / T); the key property (a draw is a pure function of
logits, params, seed and output index) by reshuffling batches and by resuming
a request from its own outputs.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from gpu_worker.sampling.draw import draw
from gpu_worker.sampling.filters import filter_logits
from gpu_worker.sampling.noise import draw_key, exponential_noise, token_bits
from gpu_worker.sampling.penalties import adjust_logits
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.sampling.top_p import TOP_P_CANDIDATES
from gpu_worker.sequence import Sequence
from shared.sampling_params import SamplingParams

EOS = 0
CPU = torch.device("cpu")


def make_seq(params: SamplingParams | None = None, *, prompt=(1,), output=(), seed=0, num_resumed=0) -> Sequence:
    return Sequence("req", list(prompt), params or SamplingParams(), seed=seed,
                    output_token_ids=list(output), num_resumed_outputs=num_resumed)


def random_logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [num_rows, vocab]


def draw_many(row: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    """Draw one token from the same logits under num_draws different seeds, in one batch."""
    seqs = [make_seq(params, seed=seed) for seed in range(num_draws)]
    return Sampler((EOS,))(row.expand(num_draws, -1).clone(), seqs).token_ids


# --- greedy ---------------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(8, 100)
    output = Sampler((EOS,))(logits, [make_seq(SamplingParams(temperature=0)) for _ in range(8)])
    assert output.token_ids == logits.argmax(dim=-1).tolist()
    assert output.logprobs == [None] * 8


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = random_logits(6, 50)
    params = [SamplingParams(temperature=0) if row % 2 else SamplingParams(top_k=5) for row in range(6)]
    output = Sampler((EOS,))(logits, [make_seq(p, seed=row) for row, p in enumerate(params)])
    for row in (1, 3, 5):
        assert output.token_ids[row] == int(logits[row].argmax())


def test_fast_path_and_full_path_agree_on_greedy():
    logits = random_logits(5, 40)
    fast = Sampler((EOS,))(logits, [make_seq(SamplingParams(temperature=0)) for _ in range(5)])
    full = Sampler((EOS,))(logits, [make_seq(SamplingParams(temperature=0, logprobs=0)) for _ in range(5)])
    assert fast.token_ids == full.token_ids


def test_callers_logits_are_left_raw():
    logits = random_logits(2, 30)
    before = logits.clone()
    params = SamplingParams(top_k=3, top_p=0.5, min_p=0.1, temperature=0.5, repetition_penalty=1.5,
                            frequency_penalty=1.0, logit_bias={4: 10.0}, min_tokens=2)
    Sampler((EOS,))(logits, [make_seq(params, output=[4, 5]), make_seq(params, seed=1)])
    assert torch.equal(logits, before)


def test_logits_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"shape \[2, vocab\]"):
        Sampler((EOS,))(torch.zeros(3, 10), [make_seq(), make_seq()])


# --- filters ----------------------------------------------------------------------------------------------------


def test_top_k_draws_only_the_k_most_likely():
    row = random_logits(1, 30, scale=0.5)[0]
    allowed = set(row.topk(4).indices.tolist())
    drawn = draw_many(row, SamplingParams(top_k=4), 400)
    assert set(drawn) == allowed  # never outside, and every allowed token turns up


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    row = probs.log()
    assert set(draw_many(row, SamplingParams(top_p=0.75), 300)) == {1, 3}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert set(draw_many(row, SamplingParams(top_p=0.85), 300)) == {1, 2, 3}
    assert set(draw_many(row, SamplingParams(top_p=0.45), 100)) == {1}


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    assert set(draw_many(probs.log(), SamplingParams(min_p=0.4), 300)) == {0, 1, 2}  # p >= 0.16


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
                                   SamplingParams(top_k=1, top_p=1e-6, min_p=1.0, temperature=5.0)])
def test_filters_always_keep_the_most_likely_token(params):
    row = random_logits(1, 1000, scale=0.01)[0]  # nearly flat: the filters cut hard
    assert set(draw_many(row, params, 50)) == {int(row.argmax())}


def test_top_k_keeps_every_token_tied_with_the_kth():
    row = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    filtered = filter_logits(row[None], [SamplingParams(top_k=2)])[0]
    assert torch.isfinite(filtered).tolist() == [True, False, True, True, False]


def reference_allowed(row: list[float], params: SamplingParams) -> set[int]:
    """Plain-Python filters, in float64: the set of tokens each filter chain leaves drawable."""
    scaled = [value / params.temperature for value in row]
    allowed = set(range(len(row)))
    if params.min_p > 0:
        best = max(scaled)
        allowed = {v for v in allowed if math.exp(scaled[v] - best) >= params.min_p}
    if params.top_k is not None and params.top_k < len(allowed):
        kth = sorted((scaled[v] for v in allowed), reverse=True)[params.top_k - 1]
        allowed = {v for v in allowed if scaled[v] >= kth}
    if params.top_p < 1:
        total = sum(math.exp(scaled[v]) for v in allowed)
        kept, mass = set(), 0.0
        for v in sorted(allowed, key=lambda v: -scaled[v]):
            if mass >= params.top_p:
                break
            kept.add(v)
            mass += math.exp(scaled[v]) / total
        allowed = kept
    return allowed


def test_filters_match_the_python_reference():
    """Peaked and flat rows, vocab past TOP_P_CANDIDATES so both of the torch top_p's paths (candidates, full sort)
    would run; on the CPU the kernel runs, tested against them in test_top_p_kernel.py."""
    rng = random.Random(0)
    vocab_size = TOP_P_CANDIDATES + 44
    logits = torch.cat([random_logits(20, vocab_size, seed=1, scale=4.0),  # peaked: nucleus among the candidates
                        random_logits(20, vocab_size, seed=2, scale=0.3)])  # flat: nucleus needs the full sort
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]), top_p=rng.choice([1.0, 0.3, 0.9, 0.99]),
                             top_k=rng.choice([None, 1, 7, 200]), min_p=rng.choice([0.0, 0.0, 0.05, 0.5]))
              for _ in range(40)]
    filtered = filter_logits(logits, params)
    for row, row_params in enumerate(params):
        got = set(torch.isfinite(filtered[row]).nonzero().squeeze(1).tolist())
        assert got == reference_allowed(logits[row].double().tolist(), row_params), (row, row_params)


def test_temperature_draws_follow_softmax_of_scaled_logits():
    """Chi-square over 20,000 seeds: below 20.5, the 0.1% tail for 5 degrees of freedom."""
    row = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    num_draws = 20_000
    for temperature in (0.7, 1.0, 2.0):
        drawn = torch.tensor(draw_many(row, SamplingParams(temperature=temperature), num_draws))
        observed = torch.bincount(drawn, minlength=6).double()
        expected = (row.double() / temperature).softmax(dim=-1) * num_draws
        chi_square = float(((observed - expected) ** 2 / expected).sum())
        assert chi_square < 20.5, (temperature, observed.tolist(), expected.tolist())


# --- values at the edge of float32 -------------------------------------------------------------------------------
# The worker applies parameters in float32, where a tiny value rounds to 0 and a huge one to inf. The frontend
# keeps such values out, but the sampler must cope on its own: whatever a value rounds to, a row keeps its most
# likely token and never draws one its filters or masks exclude.

TINY = 1e-46  # a positive float64 that is 0 in float32
HUGE = 1e300  # a finite float64 that is inf in float32


def unchecked(**fields) -> SamplingParams:
    """SamplingParams holding values that its own validation might refuse (set after construction)."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("fields", [dict(top_p=TINY), dict(top_p=TINY, top_k=3, min_p=TINY), dict(min_p=1.0),
                                   dict(temperature=TINY), dict(temperature=1e-40),
                                   dict(temperature=TINY, top_p=0.5, min_p=0.5)])
def test_a_parameter_that_rounds_to_zero_keeps_only_the_most_likely_token(fields):
    row = random_logits(1, 300, scale=3.0)[0]
    assert set(draw_many(row, unchecked(**fields), 50)) == {int(row.argmax())}


def test_a_temperature_that_rounds_to_zero_scales_the_most_likely_token_above_all_others():
    logits = random_logits(2, 300)
    filtered = filter_logits(logits, [unchecked(temperature=TINY), unchecked(temperature=1e-40)])
    assert not filtered.isnan().any()
    assert filtered.argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()
    assert (filtered == filtered.amax(dim=-1, keepdim=True)).sum(dim=-1).tolist() == [1, 1]


def test_a_temperature_that_rounds_to_inf_draws_evenly_but_never_a_masked_token():
    row = torch.tensor([5.0, 1.0, 2.0, -3.0])  # token 0 is EOS, masked by min_tokens
    drawn = draw_many(row, unchecked(temperature=HUGE, min_tokens=1), 400)
    assert set(drawn) == {1, 2, 3}


@pytest.mark.parametrize("penalty", [TINY, HUGE])
def test_a_repetition_penalty_out_of_float32_range_leaves_masked_and_zero_logits_alone(penalty):
    logits = torch.tensor([[5.0, -1.0, 0.0, -2.0]])  # EOS masked by min_tokens; seen: 0, 1, 2; unseen: 3
    seq = make_seq(unchecked(temperature=0, repetition_penalty=penalty, min_tokens=1), prompt=[0, 1, 2])
    assert Sampler((EOS,))(logits, [seq]).token_ids == [2]  # a logit of 0 stays 0 whatever the penalty
    assert not adjust_logits(logits, [seq], (EOS,)).isnan().any()


def test_nan_and_inf_logits_stay_in_their_row():
    logits, seqs = mixed_batch(8, 300)
    logits[2] = float("nan")
    logits[5, 7] = float("inf")
    logits[6, :] = float("-inf")
    sampler = Sampler((EOS,))
    together = sampler(logits, seqs).token_ids
    alone = [sampler(logits[row:row + 1], [seq]).token_ids[0] for row, seq in enumerate(seqs)]
    assert together == alone
    assert all(0 <= token_id < 300 for token_id in together)
    if not seqs[5].sampling_params.is_greedy:
        assert together[5] == 7  # the one infinitely likely token


# --- logit adjustments ----------------------------------------------------------------------------------------

RAW = [1.0, -1.0, 2.0, -2.0, 0.5, 3.0]
PROMPT = [0, 1]
OUTPUT = [1, 2, 2]


def adjusted(params: SamplingParams, *, prompt=PROMPT, output=OUTPUT, num_resumed=0) -> list[float]:
    seq = make_seq(params, prompt=prompt, output=output, num_resumed=num_resumed)
    return adjust_logits(torch.tensor([RAW]), [seq], (EOS,))[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen = prompt ∪ output = {0, 1, 2}: 1.0 / 2, -1.0 * 2, 2.0 / 2; tokens 3, 4, 5 untouched.
    assert adjusted(SamplingParams(repetition_penalty=2.0)) == [0.5, -2.0, 1.0, -2.0, 0.5, 3.0]


def test_frequency_penalty_counts_output_tokens_only():
    # output counts {1: 1, 2: 2}; prompt token 0 is untouched.
    assert adjusted(SamplingParams(frequency_penalty=0.5)) == [1.0, -1.5, 1.0, -2.0, 0.5, 3.0]


def test_presence_penalty_hits_each_output_token_once():
    assert adjusted(SamplingParams(presence_penalty=0.25)) == [1.0, -1.25, 1.75, -2.0, 0.5, 3.0]


def test_penalties_apply_in_order_repetition_frequency_presence():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert adjusted(params) == [0.5, -2.75, -0.25, -2.0, 0.5, 3.0]


def test_penalties_touch_only_their_own_row():
    seqs = [make_seq(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[5], output=[3]),
            make_seq(SamplingParams(), prompt=[5], output=[3])]
    logits = torch.tensor([RAW, RAW])
    result = adjust_logits(logits, seqs, (EOS,))
    assert result[0].tolist() == [1.0, -1.0, 2.0, -5.0, 0.5, 1.5]
    assert result[1].tolist() == RAW


def test_a_token_id_past_the_vocab_is_refused_by_penalties():
    with pytest.raises(ValueError, match="below the logits' vocab size 6, got 9"):
        adjusted(SamplingParams(repetition_penalty=2.0), prompt=[9])


def test_logit_bias_adds_to_the_named_tokens():
    params = SamplingParams(logit_bias={4: 5.0, 5: -100.0, 60: 1.0})  # 60 lies past the vocab: ignored
    assert adjusted(params) == [1.0, -1.0, 2.0, -2.0, 5.5, -97.0]
    greedy = SamplingParams(temperature=0, logit_bias={3: 10.0})
    assert Sampler((EOS,))(torch.tensor([RAW]), [make_seq(greedy)]).token_ids == [3]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    minus_inf = float("-inf")
    assert adjusted(params, output=[]) == [minus_inf, -1.0, 2.0, -2.0, 0.5, minus_inf]
    assert adjusted(params, output=[3]) == [minus_inf, -1.0, 2.0, -2.0, 0.5, minus_inf]
    assert adjusted(params, output=[3, 3]) == RAW


def test_min_tokens_counts_only_outputs_of_this_engine_run():
    params = SamplingParams(min_tokens=1, stop_token_ids=(5,))
    masked = adjusted(params, output=[3, 3, 3], num_resumed=3)  # resumed: nothing new generated yet
    assert masked[EOS] == float("-inf") and masked[5] == float("-inf")


def test_greedy_with_min_tokens_skips_eos_then_allows_it():
    logits = torch.tensor([[5.0, 1.0, 2.0]])  # EOS is the best token
    params = SamplingParams(temperature=0, min_tokens=1)
    assert Sampler((EOS,))(logits, [make_seq(params)]).token_ids == [2]
    assert Sampler((EOS,))(logits, [make_seq(params, output=[2])]).token_ids == [EOS]


def test_ignore_eos_is_not_the_samplers_business():
    logits = torch.tensor([[5.0, 1.0, 2.0]])
    assert Sampler((EOS,))(logits, [make_seq(SamplingParams(temperature=0, ignore_eos=True))]).token_ids == [EOS]


# --- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution_with_top_k_in_order():
    logits = random_logits(3, 50)
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, logit_bias={7: 20.0}),
              SamplingParams(logprobs=0, temperature=0),
              SamplingParams()]
    seqs = [make_seq(p, prompt=[1, 2, 3], output=[4], seed=row) for row, p in enumerate(params)]
    output = Sampler((EOS,))(logits, seqs)
    raw = logits.log_softmax(dim=-1)  # [3, 50]
    first = output.logprobs[0]
    assert first.token_id == output.token_ids[0]
    assert first.logprob == pytest.approx(float(raw[0, first.token_id]), abs=1e-6)
    expected_top = raw[0].topk(5)
    assert first.top_token_ids == expected_top.indices.tolist()
    assert first.top_logprobs == pytest.approx(expected_top.values.tolist(), abs=1e-6)
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)
    second = output.logprobs[1]
    assert (second.token_id, second.top_token_ids, second.top_logprobs) == (int(logits[1].argmax()), [], [])
    assert second.logprob == pytest.approx(float(raw[1].max()), abs=1e-6)
    assert output.logprobs[2] is None


# --- the draw: counter-based noise ------------------------------------------------------------------------------


def test_noise_matches_the_per_element_python_reference():
    keys = [draw_key(seed, index) for seed, index in [(0, 0), (1, 0), (0, 1), (-5, 3), (2 ** 70, 9)]]
    noise = exponential_noise(keys, 1000, CPU)  # [5, 1000]
    for row, key in enumerate(keys):
        for token_id in (0, 1, 2, 511, 999):
            uniform = ((token_bits(key, token_id) >> 9) + 0.5) / 2 ** 23
            assert float(noise[row, token_id]) == pytest.approx(-math.log(uniform), rel=1e-6, abs=1e-7)


def test_noise_looks_like_exp_1():
    noise = exponential_noise([draw_key(seed, 0) for seed in range(20)], 5000, CPU)  # [20, 5000]
    assert float(noise.min()) > 0
    assert float(noise.mean()) == pytest.approx(1.0, abs=0.02)
    assert float(noise.var()) == pytest.approx(1.0, abs=0.05)
    neighbours = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.02


def test_noise_differs_by_seed_and_by_output_index():
    base = exponential_noise([draw_key(7, 3)], 256, CPU)
    for other in (draw_key(7, 4), draw_key(8, 3), draw_key(7, 2)):
        assert not torch.equal(base, exponential_noise([other], 256, CPU))
    assert torch.equal(base, exponential_noise([draw_key(7, 3)], 256, CPU))


def test_draws_vary_with_output_index():
    row = torch.zeros(1, 1000)  # uniform: the draw is the noise's argmax
    tokens = {int(draw(row, [draw_key(42, index)])[0]) for index in range(20)}
    assert len(tokens) > 15


def mixed_batch(num_seqs: int, vocab_size: int) -> tuple[torch.Tensor, list[Sequence]]:
    rng = random.Random(3)
    seqs = []
    for index in range(num_seqs):
        params = SamplingParams(temperature=rng.choice([0, 0.6, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([None, 20]), min_p=rng.choice([0.0, 0.02]),
                                repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
                                logprobs=rng.choice([None, 2]))
        output = [rng.randrange(vocab_size) for _ in range(rng.randrange(6))]
        seqs.append(make_seq(params, prompt=[rng.randrange(vocab_size) for _ in range(4)], output=output,
                             seed=rng.randrange(2 ** 63)))
    return random_logits(num_seqs, vocab_size, seed=9, scale=1.0), seqs


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch():
    logits, seqs = mixed_batch(24, 300)
    sampler = Sampler((EOS,))
    together = sampler(logits, seqs).token_ids
    alone = [sampler(logits[row:row + 1], [seq]).token_ids[0] for row, seq in enumerate(seqs)]
    order = list(range(24))
    random.Random(1).shuffle(order)
    shuffled = sampler(logits[order], [seqs[row] for row in order]).token_ids
    assert together == alone
    assert [shuffled[order.index(row)] for row in range(24)] == together
    assert len(set(together)) > 10  # not trivially equal


def toy_model_logits(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """A deterministic stand-in for a model: next-token logits from the last token and the length."""
    generator = torch.Generator().manual_seed(token_ids[-1] * 1000 + len(token_ids))
    return torch.randn(vocab_size, generator=generator) * 1.5  # [vocab]


def generate(seq: Sequence, num_steps: int, sampler: Sampler, vocab_size: int) -> list[int]:
    """Step a request alone (beside an unrelated greedy one) and feed its outputs back."""
    bystander = make_seq(SamplingParams(temperature=0), prompt=[3])
    for _ in range(num_steps):
        logits = torch.stack([toy_model_logits(seq.prompt_token_ids + seq.output_token_ids, vocab_size),
                              toy_model_logits([3], vocab_size)])  # [2, vocab]
        seq.output_token_ids.append(sampler(logits, [seq, bystander]).token_ids[0])
    return seq.output_token_ids


def test_a_resumed_request_continues_with_the_same_tokens():
    vocab_size, num_steps, min_tokens = 120, 12, 4
    sampler = Sampler((EOS,))

    def params(num_done: int) -> SamplingParams:
        return SamplingParams(max_tokens=num_steps - num_done, min_tokens=max(0, min_tokens - num_done),
                              temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.2,
                              presence_penalty=0.3, frequency_penalty=0.2, seed=7)

    uninterrupted = generate(make_seq(params(0), prompt=[5, 6, 7], seed=7), num_steps, sampler, vocab_size)
    assert len(set(uninterrupted)) > 3
    for num_done in (1, 5, 9):
        resumed = make_seq(params(num_done), prompt=[5, 6, 7], output=uninterrupted[:num_done], seed=7,
                           num_resumed=num_done)
        assert generate(resumed, num_steps - num_done, sampler, vocab_size) == uninterrupted


def test_a_different_seed_takes_a_different_path():
    sampler = Sampler((EOS,))
    first = generate(make_seq(SamplingParams(), prompt=[5], seed=1), 10, sampler, 120)
    second = generate(make_seq(SamplingParams(), prompt=[5], seed=2), 10, sampler, 120)
    assert first != second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_same_noise_and_tokens_as_the_cpu():
    keys = [draw_key(seed, 5) for seed in range(8)]
    cpu_noise = exponential_noise(keys, 4096, CPU)
    cuda_noise = exponential_noise(keys, 4096, torch.device("cuda")).cpu()
    assert float((cpu_noise - cuda_noise).abs().max()) <= 1e-5
    logits, seqs = mixed_batch(24, 300)
    assert Sampler((EOS,))(logits.cuda(), seqs).token_ids == Sampler((EOS,))(logits, seqs).token_ids
