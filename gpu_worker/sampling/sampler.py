"""Sampler: turns a step's last-token logits into one token id per sequence.

Owns: the grammar's mask (structured output), logit_bias, min_tokens,
repetition / frequency / presence penalties, greedy choice, temperature,
min_p, top_k, top_p, the draw, and logprobs of the raw model distribution. Knows nothing of scheduling, the KV cache or
stopping: ignore_eos, stop tokens and max_tokens are the engine's business
(min_tokens is here only because it changes which tokens may be drawn).

Per row, in order: raw logprobs (if asked) -> grammar mask -> logit_bias ->
min_tokens -> penalties -> greedy rows take the argmax; the others go
through temperature -> min_p -> top_k -> top_p and then the draw.

The draw is an exponential race, token = argmax(p / E) with E ~ Exp(1) per
token, done in log space as argmax(logit - log E). E comes from
counter-based noise keyed by (seed, output_index) (see sampling/noise.py;
the draw itself, and the greedy argmax, are sampling/draw.py's, unless the
LM head's kernel took the argmax already),
so a row's token is a pure function of its processed logits, its params,
its seed and its output index: independent of the rest of the batch and of
any earlier step. A request re-run with its first k outputs handed back
draws the same tokens from there on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.sampling.draw import filter_and_draw, greedy_tokens
from gpu_worker.sampling.logprobs import gather_logprobs, raw_logprobs
from gpu_worker.sampling.noise import draw_key
from gpu_worker.sampling.penalties import adjust_logits
from gpu_worker.sequence import Sequence
from shared.logprobs import TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "TokenLogprobs"]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per sequence, in the order of the logits' rows
    logprobs: list[TokenLogprobs | None]  # None where the request asked for no logprobs


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None
                 ) -> SamplerOutput:
        """logits: [num_seqs, vocab] float32, row i the next-token logits of seqs[i]; argmax: each row's argmax of
        logits where the forward pass took it already, which it does only when every row is plain greedy
        (StepLogits.argmax): then it is the step's tokens, and the rows are not checked again; else None."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"expected logits of shape [{len(seqs)}, vocab], got {tuple(logits.shape)}")
        if argmax is not None:
            return SamplerOutput(argmax.tolist(), [None] * len(seqs))
        if all(seq.is_plain_greedy for seq in seqs):
            return SamplerOutput(greedy_tokens(logits).tolist(), [None] * len(seqs))

        num_top = {row: seq.sampling_params.logprobs for row, seq in enumerate(seqs)
                   if seq.sampling_params.logprobs is not None}  # row -> top-k, of the rows that ask for logprobs
        logprob_rows = list(num_top)
        logprobs = raw_logprobs(logits, logprob_rows) if logprob_rows else None  # [num_logprob_rows, vocab]
        token_ids = self._pick(adjust_logits(logits, seqs, self.eos_token_ids), seqs).tolist()

        per_row: list[TokenLogprobs | None] = [None] * len(seqs)
        if logprobs is not None:
            chosen = [token_ids[row] for row in logprob_rows]
            for row, row_logprobs in zip(logprob_rows, gather_logprobs(logprobs, chosen, list(num_top.values()))):
                per_row[row] = row_logprobs
        return SamplerOutput(token_ids, per_row)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Greedy rows take the argmax of their adjusted logits; the others are filtered and drawn. [num_seqs]."""
        greedy_rows = [row for row, seq in enumerate(seqs) if seq.sampling_params.is_greedy]
        sampled_rows = [row for row, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if not sampled_rows:
            return greedy_tokens(logits)  # [num_seqs]
        if not greedy_rows:  # every row draws: no gather and scatter
            return filter_and_draw(logits, [seq.sampling_params for seq in seqs],
                                   [draw_key(seq.seed, seq.output_index) for seq in seqs])
        token_ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)  # [num_seqs]
        greedy_index = torch.tensor(greedy_rows, dtype=torch.int64, device=logits.device)
        token_ids[greedy_index] = greedy_tokens(logits.index_select(0, greedy_index))
        sampled_index = torch.tensor(sampled_rows, dtype=torch.int64, device=logits.device)
        sampled = [seqs[row] for row in sampled_rows]
        token_ids[sampled_index] = filter_and_draw(logits.index_select(0, sampled_index),
                                                   [seq.sampling_params for seq in sampled],
                                                   [draw_key(seq.seed, seq.output_index) for seq in sampled])
        return token_ids

