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


def unseen_prompt_logprobs(num_held: int, start: int, entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
    """Of prompt logprobs for positions start, start + 1, ..., those past the num_held positions already held
    (positions count from 1: position 0 has none). A recompute may send positions again; each is kept once, the
    first time. ValueError for a gap."""
    next_position = num_held + 1
    if start > next_position:
        raise ValueError(f"prompt logprobs from position {start}, but position {next_position} has none yet "
                         f"(expected a start of at most {next_position})")
    return entries[next_position - start:]
