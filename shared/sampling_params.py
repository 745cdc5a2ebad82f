"""SamplingParams: how one request picks its tokens and when it stops.

Shared by the frontend (which builds it from an OpenAI request body) and the
worker (which applies it). Validated on construction: a bad value raises a
ValueError naming the field and the value, so neither process can be handed
parameters it cannot honour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


def _require(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters.

    `temperature == 0` means greedy. `top_k is None` and `top_p == 1` disable
    those filters. `logprobs is None` returns no logprobs; `logprobs == k`
    returns the sampled token's logprob and the k most likely tokens'.
    `max_tokens` and `min_tokens` count tokens still to generate: a request
    resumed with some output already produced is given what remains.
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

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                 f"an integer between 0 and max_tokens ({self.max_tokens})")
        _require(_is_finite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                 "a number >= 0")
        _require(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1), "top_k", self.top_k,
                 "None or an integer >= 1")
        _require(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _require(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 self.repetition_penalty, "a number > 0")
        _require(_is_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
                 self.presence_penalty, "a number in [-2, 2]")
        _require(_is_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
                 self.frequency_penalty, "a number in [-2, 2]")
        _require(isinstance(self.logit_bias, dict) and all(
            _is_int(k) and k >= 0 and _is_finite(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()),
            "logit_bias", self.logit_bias, "a map of token id (>= 0) to a bias in [-100, 100]")
        self.stop_token_ids = tuple(self.stop_token_ids)
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
                 "token ids >= 0")
        _require(self.seed is None or _is_int(self.seed), "seed", self.seed, "None or an integer")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                 "logprobs", self.logprobs, f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
