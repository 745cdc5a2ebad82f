"""TokenLogprobs: one token's logprob and the most likely alternatives at its position.

A generated token's come from the worker's sampler; a prompt token's (prompt
logprobs: its log-probability given the prompt before it) from the prefill
that computes its position. Carried over the wire, rendered by the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: list[int]  # the k most likely token ids, most likely first
    top_logprobs: list[float]
    rank: int | None = None  # prompt logprobs: the token's rank in the distribution, 1 the likeliest
