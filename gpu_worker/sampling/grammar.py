"""Structured output in the worker: a grammar matcher per constrained request, and the batched token mask.

A request whose SamplingParams carry a grammar (llguidance's JSON form,
built and validated by the frontend: server/generation/structured_output.py)
gets a GrammarState at admission: an llguidance matcher over this model's
tokenizer that has already consumed the request's output so far, so that a
request resumed after a worker death continues from where it stood. Each
step the sampler asks for the masks of all its constrained rows at once
(`mask_disallowed`): llguidance fills them on its own threads, without the
GIL, and every token the grammar does not allow is excluded before any other
adjustment, so no sampled token can leave the grammar. EOS is allowed only
where the grammar may end; once a token leaves the grammar nothing more to
add, the sequence is finished ("stop") without spending a step on the EOS.

Matchers are built once per distinct grammar and copied for each request
(`Grammars.state`); the frontend has already refused what llguidance cannot
compile, and llguidance's own limits (lexer fuel, grammar size, recursion
depth) bound what a hostile grammar costs here too: a matcher that hits one
is an error of that request alone.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import llguidance
import llguidance.numpy
import torch

from gpu_worker.sampling.token_mask import apply_token_bitmask

MATCHERS_CACHED = 64  # distinct grammars kept compiled; a request with another one compiles it again


class GrammarError(ValueError):
    """A grammar this worker cannot follow, or output it does not allow."""


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        """Take in the request's next output token; GrammarError when the grammar does not allow it."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not follow the request's grammar: {self.matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (the grammar is complete, or its matcher failed)."""
        return self.matcher.is_stopped()


class Grammars:
    """Builds GrammarStates against one model's tokenizer; the tokenizer is read at the first grammar."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> a matcher at its start

    def state(self, grammar: str, output_token_ids: list[int] | tuple[int, ...] = ()) -> GrammarState:
        """A fresh state of `grammar`, past `output_token_ids` (a resumed request's output); GrammarError if the
        grammar does not compile here or the output does not follow it."""
        matcher = self._matchers.get(grammar)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(f"the request's grammar does not compile: {matcher.get_error()}")
            self._matchers[grammar] = matcher
            if len(self._matchers) > MATCHERS_CACHED:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(grammar)
        state = GrammarState(matcher.deep_copy())
        if output_token_ids and not state.matcher.consume_tokens(list(output_token_ids)):
            raise GrammarError(f"the request's output so far does not follow its grammar: {state.matcher.get_error()}")
        return state

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not self.tokenizer_file.is_file():
                raise GrammarError(f"structured output needs the model's tokenizer, and {self.tokenizer_file} "
                                   "does not exist")
            try:
                self._tokenizer = llguidance.LLTokenizer(str(self.tokenizer_file), n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids))
            except ValueError as exc:  # e.g. a tokenizer with more tokens than the model has rows of logits
                raise GrammarError(f"structured output cannot use {self.tokenizer_file}: {exc}") from None
        return self._tokenizer


_executor: llguidance.LLExecutor | None = None


def mask_disallowed(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Set to -inf, in place, every logit its row's grammar does not allow next; rows without one are left alone.

    logits: [num_rows, vocab] float32, row i the next-token logits of the request whose state is states[i].
    """
    global _executor
    constrained = [(row, state) for row, state in enumerate(states) if state is not None]
    if not constrained:
        return
    if _executor is None:  # the sampler runs between forward passes: the cores are the masks' for a moment
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    bitmask = llguidance.numpy.allocate_token_bitmask(len(constrained), logits.shape[1])  # [rows, words] int32
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor, [(state.matcher, i) for i, (_, state) in enumerate(constrained)], bitmask)
    apply_token_bitmask(logits, [row for row, _ in constrained], bitmask)
