"""SamplingParams: how one request picks its tokens and when it stops.

Shared by the frontend (which builds it from an OpenAI request body) and the
worker (which applies it). Validated on construction: a bad value raises a
ValueError naming the field and the value, so neither process can be handed
parameters it cannot honour.

This is the one place that knows the worker's numeric types. Counts and
token ids travel as int32 (token ids in raw frames, the rest in JSON that
must stay within 64 bits), seeds as 63-bit integers, and the sampler works in
float32: every number accepted here survives both. A temperature below
GREEDY_TEMPERATURE is greedy (dividing logits by it would overflow float32);
a top_p or min_p too small for float32 keeps what it means, the most likely
token, because the filters always keep that one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.vocabulary import SEED_BITS

MAX_INT32 = 2**31 - 1  # counts, token ids and priorities cross the wire as int32
GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy, as in vLLM
# Logits are scaled by 1 / repetition_penalty or by it: within these bounds a float32 logit stays finite.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
MAX_LOGIT_BIAS = 100.0


def _require(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {_clip(value)}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    `temperature < GREEDY_TEMPERATURE` (0 included) means greedy. `top_k is
    None` and `top_p == 1` disable those filters. `logprobs is None` returns
    no logprobs; `logprobs == k` returns the sampled token's logprob and the
    k most likely tokens'. `prompt_logprobs == k` does the same for every
    prompt token after the first, given the tokens before it (the server's
    --max-logprobs bounds both k; the engine, the vocabulary). `grammar` is built and checked by the frontend
    (server/generation/structured_output.py) and followed by the worker's
    sampler (gpu_worker/sampling/grammar.py). `max_tokens` and `min_tokens` count tokens still
    to generate: a request resumed with some output already produced is
    given what remains.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None  # structured output: an llguidance grammar (its JSON text) the output must follow

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens, 1), "max_tokens", self.max_tokens, f"an integer in [1, {MAX_INT32}]")
        _require(_is_int(self.min_tokens, 0, self.max_tokens), "min_tokens", self.min_tokens,
                 f"an integer between 0 and max_tokens ({self.max_tokens})")
        _require(_is_finite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                 "a number >= 0")
        _require(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require(self.top_k is None or _is_int(self.top_k, 1), "top_k", self.top_k,
                 f"None or an integer in [1, {MAX_INT32}]")
        _require(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _require(_is_finite(self.repetition_penalty)
                 and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                 "repetition_penalty", self.repetition_penalty,
                 f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_finite(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _require(isinstance(self.logit_bias, dict) and all(
            _is_int(k, 0) and _is_finite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
            for k, v in self.logit_bias.items()),
            "logit_bias", self.logit_bias, f"a map of token id (an integer in [0, {MAX_INT32}]) to a bias in "
                                           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        self.stop_token_ids = tuple(self.stop_token_ids)
        _require(all(_is_int(t, 0) for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
                 f"token ids in [0, {MAX_INT32}]")
        _require(self.seed is None or _is_int(self.seed, 0, 2**SEED_BITS - 1), "seed", self.seed,
                 f"None or an integer in [0, 2**{SEED_BITS})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value, 0), name, value, f"None or an integer in [0, {MAX_INT32}]")
        _require(self.grammar is None or (isinstance(self.grammar, str) and bool(self.grammar)), "grammar",
                 self.grammar, "None or a non-empty string")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(value: object, minimum: int, maximum: int = MAX_INT32) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _clip(value: object, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
