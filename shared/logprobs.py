"""TokenLogprobs: one generated token's logprob and the most likely alternatives at its position.

Produced by the worker's sampler, carried over the wire, rendered by the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: list[int]  # the k most likely token ids, most likely first
    top_logprobs: list[float]
