"""Prompt logprobs: each prompt token's log-probability given the tokens before it, from the prefill that runs.

The hidden state at position p predicts the token at p + 1, so a prefill
chunk covering positions start..end-1 scores the prompt tokens at
start+1..end (those that are prompt tokens and still to be sent). Only the
rows of requests that ask go through the LM head, a slice of rows at a time
so that the [rows, vocab] float32 logits stay within SLICE_BYTES whatever the
chunk's length.

Per scored token: its logprob under log_softmax of the raw logits, its rank
(1 + the number of tokens strictly likelier) and the k likeliest tokens, as
vLLM reports prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.logprobs import TokenLogprobs

SLICE_BYTES = 64 * 2**20  # float32 logits held at once while scoring prompt tokens


@dataclass(slots=True)
class PromptTokenRows:
    """The prompt tokens one step scores: per token, the hidden row that predicts it, its id and its top-k."""

    hidden_rows: list[int]
    token_ids: list[int]
    num_top: list[int]

    @classmethod
    def empty(cls) -> PromptTokenRows:
        return cls([], [], [])

    def add(self, first_row: int, token_ids: list[int], num_top: int) -> None:
        """Tokens predicted by consecutive hidden rows from first_row on."""
        self.hidden_rows.extend(range(first_row, first_row + len(token_ids)))
        self.token_ids.extend(token_ids)
        self.num_top.extend([num_top] * len(token_ids))


def score_prompt_tokens(hidden: torch.Tensor, rows: PromptTokenRows, vocab_size: int,
                        compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[TokenLogprobs]:
    """hidden: [num_tokens, hidden_size] of the step; compute_logits: the LM head, [n, hidden] -> [n, vocab] float32.
    One TokenLogprobs (rank set) per token of `rows`, in its order."""
    index = torch.tensor(rows.hidden_rows, dtype=torch.int64, device=hidden.device)  # [num_rows]
    targets = torch.tensor(rows.token_ids, dtype=torch.int64, device=hidden.device)  # [num_rows]
    slice_rows = max(1, SLICE_BYTES // (vocab_size * 4))
    result: list[TokenLogprobs] = []
    for start in range(0, len(rows.hidden_rows), slice_rows):
        end = start + slice_rows
        logits = compute_logits(hidden.index_select(0, index[start:end]))  # [rows in slice, vocab] float32
        result.extend(_score(logits.log_softmax(dim=-1), targets[start:end], rows.num_top[start:end]))
    return result


def _score(logprobs: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs: [n, vocab]; targets: [n] the scored token ids; num_top: per row, how many alternatives."""
    chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # [n]
    top_logprobs, top_ids = logprobs.topk(max(num_top), dim=-1)  # [n, max_top] each, likeliest first
    return [TokenLogprobs(token_id, logprob, ids[:k], values[:k], rank)
            for token_id, logprob, ids, values, k, rank
            in zip(targets.tolist(), chosen.squeeze(1).tolist(), top_ids.tolist(), top_logprobs.tolist(), num_top,
                   ranks)]
