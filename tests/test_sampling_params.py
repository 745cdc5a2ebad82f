"""SamplingParams: every value it accepts survives the wire (int32 counts and ids, 63-bit seeds) and float32."""

from __future__ import annotations

import pytest

from shared.protocol import Add, decode, encode
from shared.sampling_params import GREEDY_TEMPERATURE, MAX_INT32, SamplingParams
from shared.vocabulary import SEED_BITS


@pytest.mark.parametrize("temperature, is_greedy", [(0, True), (1e-40, True), (GREEDY_TEMPERATURE / 2, True),
                                                    (GREEDY_TEMPERATURE, False), (0.7, False)])
def test_temperatures_below_the_threshold_are_greedy(temperature, is_greedy):
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


@pytest.mark.parametrize("fields, name", [
    ({"max_tokens": MAX_INT32 + 1}, "max_tokens"),
    ({"top_k": 10**20}, "top_k"),
    ({"stop_token_ids": (MAX_INT32 + 1,)}, "stop_token_ids"),
    ({"logit_bias": {10**20: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"seed": 2**SEED_BITS}, "seed"),
    ({"seed": -1}, "seed"),
    ({"repetition_penalty": 1e-46}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": float("inf")}, "temperature"),
])
def test_values_the_worker_cannot_hold_raise_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name} must be") as info:
        SamplingParams(**fields)
    assert len(str(info.value)) < 300


def test_the_largest_accepted_values_cross_the_wire():
    params = SamplingParams(max_tokens=MAX_INT32, top_k=MAX_INT32, stop_token_ids=(MAX_INT32,),
                            logit_bias={MAX_INT32: 100.0}, seed=2**SEED_BITS - 1, top_p=1e-46, min_p=1e-46)
    assert decode(encode(Add("r", [1], params))).params == params
