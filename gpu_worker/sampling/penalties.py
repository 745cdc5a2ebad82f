"""Logit adjustments that apply to greedy and sampled rows alike.

In order: the grammar's mask (structured output, gpu_worker/sampling/grammar.py),
logit_bias, min_tokens, then the penalties (repetition, frequency,
presence). Each step touches only the rows that ask for it; each builds its
token-id index tensors on the host from the sequences' plain lists and sends
them to the logits' device once. Token ids at or beyond the logits' vocab
(a bias or stop id past a padded vocab) are skipped: those tokens cannot be
drawn anyway.

Prompt and output stay distinct: the repetition penalty looks at every token
of prompt + output, frequency and presence at the output only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from gpu_worker.sampling.grammar import mask_disallowed
from gpu_worker.sequence import Sequence

_FLOAT32 = torch.finfo(torch.float32)


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """grammar -> logit_bias -> min_tokens -> penalties: [num_seqs, vocab] float32 in and out.

    Works on a copy; `logits` itself is returned, unmodified, when no row needs adjusting.
    """
    if not any(needs_adjusting(seq, eos_token_ids) for seq in seqs):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)  # [num_seqs, vocab]; the caller's logits stay raw
    mask_disallowed(logits, [seq.grammar for seq in seqs])
    apply_logit_bias(logits, seqs)
    apply_min_tokens(logits, seqs, eos_token_ids)
    apply_penalties(logits, seqs)
    return logits


def needs_adjusting(seq: Sequence, eos_token_ids: tuple[int, ...]) -> bool:
    params = seq.sampling_params
    return (seq.grammar is not None or bool(params.logit_bias) or params.has_penalties
            or bool(_min_tokens_masked_ids(seq, eos_token_ids)))


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """logits[row, token] += bias for each (token, bias) of each row's logit_bias, in place."""
    vocab_size = logits.shape[1]
    entries = [(row, token_id, bias) for row, seq in enumerate(seqs)
               for token_id, bias in seq.sampling_params.logit_bias.items() if token_id < vocab_size]
    if not entries:
        return
    rows, token_ids, biases = zip(*entries)
    index = _index_tensors(rows, token_ids, logits.device)
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> None:
    """Until a row has min_tokens new outputs, its EOS and stop token ids cannot be drawn; in place."""
    vocab_size = logits.shape[1]
    entries = [(row, token_id) for row, seq in enumerate(seqs)
               for token_id in _min_tokens_masked_ids(seq, eos_token_ids) if token_id < vocab_size]
    if not entries:
        return
    rows, token_ids = zip(*entries)
    logits[_index_tensors(rows, token_ids, logits.device)] = float("-inf")


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition, then frequency, then presence penalty, in place on a contiguous [num_seqs, vocab].

    Only the (row, token) entries a penalty touches are read and written, through flat
    positions row * vocab + token: the cost follows the number of tokens seen, not the vocab.
    """
    vocab_size = logits.shape[1]
    flat_logits = logits.view(-1)  # [num_seqs * vocab]
    repeated = [(row, seq) for row, seq in enumerate(seqs) if seq.sampling_params.repetition_penalty != 1]
    if repeated:
        positions = _flat_positions([(row, itertools.chain(seq.prompt_token_ids, seq.output_token_ids))
                                     for row, seq in repeated], vocab_size, logits.device).unique()  # [num_seen]
        # Kept inside float32's finite positive range, so that no penalty makes 0 * inf or -inf * 0, both NaN.
        penalty = _per_row(logits, [seq.sampling_params.repetition_penalty for seq in seqs]).clamp_(
            _FLOAT32.tiny, _FLOAT32.max)[positions // vocab_size]  # [num_seen]
        values = flat_logits[positions]  # [num_seen]
        # A positive logit is divided and a negative one multiplied, so a penalty > 1 always lowers the token.
        flat_logits[positions] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [(row, seq.output_token_ids) for row, seq in enumerate(seqs)
               if seq.sampling_params.frequency_penalty != 0 or seq.sampling_params.presence_penalty != 0]
    if counted:
        positions, counts = _flat_positions(counted, vocab_size, logits.device).unique(return_counts=True)
        rows = positions // vocab_size  # [num_distinct_outputs]
        frequency = _per_row(logits, [seq.sampling_params.frequency_penalty for seq in seqs])[rows]
        presence = _per_row(logits, [seq.sampling_params.presence_penalty for seq in seqs])[rows]
        flat_logits[positions] = flat_logits[positions] - frequency * counts - presence


def _min_tokens_masked_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    params = seq.sampling_params
    if seq.num_new_outputs >= params.min_tokens:
        return ()
    return eos_token_ids + params.stop_token_ids


def _flat_positions(token_lists: Iterable[tuple[int, Iterable[int]]], vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """row * vocab_size + token_id for every token of every (row, token ids) pair: [num_listed] int64."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, row_token_ids in token_lists:
        num_before = len(token_ids)
        token_ids.extend(row_token_ids)
        rows.extend(itertools.repeat(row, len(token_ids) - num_before))
    token_tensor = torch.tensor(token_ids, dtype=torch.int64)  # [num_listed]
    if token_ids and int(token_tensor.max()) >= vocab_size:  # it would land in the next row
        raise ValueError(f"expected token ids below the logits' vocab size {vocab_size}, got {int(token_tensor.max())}")
    return (torch.tensor(rows, dtype=torch.int64) * vocab_size + token_tensor).to(device)


def _index_tensors(rows, token_ids, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device))


def _per_row(like: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)  # [num_seqs]
