"""Logprobs of the raw model distribution, log_softmax(logits) before any adjustment or filter.

That is what vLLM returns by default and what a client comparing against the
model expects: the sampled token's logprob under the model, plus the k most
likely tokens. Computed only for the rows that ask, on the raw logits.
"""

from __future__ import annotations

import torch

from shared.logprobs import TokenLogprobs


def raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """log_softmax of the raw logits of `rows`: [len(rows), vocab] float32."""
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [num_rows]
    return logits.index_select(0, row_index).log_softmax(dim=-1)  # [num_rows, vocab]


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Per row of `logprobs` [num_rows, vocab]: the logprob of token_ids[row] and the num_top[row] best."""
    chosen = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)[:, None]  # [num_rows, 1]
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()  # [num_rows]
    top_logprobs, top_token_ids = logprobs.topk(max(num_top), dim=-1)  # [num_rows, max_top] each, best first
    top_logprobs, top_token_ids = top_logprobs.tolist(), top_token_ids.tolist()
    return [TokenLogprobs(token_id, logprob, ids[:k], values[:k])
            for token_id, logprob, ids, values, k
            in zip(token_ids, chosen_logprobs, top_token_ids, top_logprobs, num_top)]
