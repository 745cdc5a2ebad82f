"""Filters for the rows that sample: temperature, then min_p, top_k, top_p.

Each filter sets the logits of the tokens it excludes to -inf and always
keeps the most likely token, so a row can never end up with nothing to draw.
Ties at a boundary are kept (top_k may keep more than k tokens when several
share the k-th logit). Work is spent only on the rows that ask for a filter:
top_k uses a partial top-k, and top_p's cutoff is found without a full sort
(sampling/top_p.py).

That guarantee holds whatever a parameter becomes in float32 (a tiny top_p
or temperature rounds to 0, a huge temperature to inf) and whatever the
logits hold: a NaN logit counts as excluded, +inf as the largest float, and
a row is scaled relative to its best logit, so that token is at 0 after any
temperature while the others go to -inf at worst, never to NaN. A row never
affects another: every operation here works row by row.
"""

from __future__ import annotations

import torch

from gpu_worker.sampling.top_p import exclude_outside_nucleus
from shared.sampling_params import SamplingParams

_EXCLUDED = float("-inf")
_FLOAT32 = torch.finfo(torch.float32)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled, filtered logits of sampled rows: [num_rows, vocab] float32, excluded = -inf.

    Returns a new tensor; `logits` is not modified. Each row's best token ends at 0, the others below it.
    """
    # A temperature that is 0 or inf in float32 acts as the smallest or largest float32: greedy, or even.
    temperature = _column(logits, [p.temperature for p in params]).clamp_(_FLOAT32.tiny, _FLOAT32.max)
    logits = relative_to_best(logits).div_(temperature)  # [num_rows, vocab], a new tensor the filters edit in place
    apply_min_p(logits, params)
    apply_top_k(logits, params)
    apply_top_p(logits, params)
    return logits


def relative_to_best(logits: torch.Tensor) -> torch.Tensor:
    """logits minus each row's largest, NaN taken as excluded and +inf as the largest float: [num_rows, vocab].

    The best token of a row is then at 0 and no entry is NaN, so no scaling or filter can turn the row to NaN;
    a row where every token is excluded stays all -inf.
    """
    logits = logits.nan_to_num(nan=_EXCLUDED, posinf=_FLOAT32.max, neginf=_EXCLUDED)  # [num_rows, vocab]
    best = logits.amax(dim=-1, keepdim=True).clamp_(min=-_FLOAT32.max)  # [num_rows, 1], finite
    return logits.sub_(best)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Keep tokens with p >= min_p * p_max, i.e. logit >= max logit + log(min_p); in place."""
    if all(p.min_p == 0 for p in params):
        return
    log_min_p = _column(logits, [p.min_p for p in params]).log()  # [num_rows, 1]; log(0) = -inf keeps all
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p  # [num_rows, 1]
    logits.masked_fill_(logits < threshold, _EXCLUDED)


def apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Keep tokens whose logit is at least the row's k-th largest; in place."""
    vocab_size = logits.shape[1]
    top_k = {row: p.top_k for row, p in enumerate(params) if p.top_k is not None and p.top_k < vocab_size}  # row -> k
    if not top_k:
        return
    row_index = torch.tensor(list(top_k), dtype=torch.int64, device=logits.device)  # [num_top_k]
    ks = torch.tensor(list(top_k.values()), dtype=torch.int64, device=logits.device)  # [num_top_k]
    sub = logits.index_select(0, row_index)  # [num_top_k, vocab]
    top_values = sub.topk(max(top_k.values()), dim=-1).values  # [num_top_k, max_k], descending
    kth_value = top_values.gather(1, (ks - 1)[:, None])  # [num_top_k, 1]
    logits.index_copy_(0, row_index, sub.masked_fill_(sub < kth_value, _EXCLUDED))


def apply_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Keep the most likely tokens until their probability reaches top_p (renormalised after the filters above).

    A token is kept when the tokens more likely than it hold less than top_p, so the most likely token
    always is; ties with the last kept token are kept too. In place.
    """
    rows = [row for row, p in enumerate(params) if p.top_p < 1]
    if not rows:
        return
    top_p = _column(logits, [params[row].top_p for row in rows])  # [num_top_p, 1]
    if len(rows) == len(params):  # every row asks: filtered where they lie, with no gather and scatter
        exclude_outside_nucleus(logits, logits.softmax(dim=-1), top_p)
        return
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [num_top_p]
    sub = logits.index_select(0, row_index)  # [num_top_p, vocab]
    exclude_outside_nucleus(sub, sub.softmax(dim=-1), top_p)
    logits.index_copy_(0, row_index, sub)


def _column(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [num_rows, 1]
