"""ChoiceOutput: one choice's tokens -> the text and logprobs a client is sent, piece by piece.

Owns: reading what the engine appended to a RequestState since the last
look, detokenizing it, applying stop strings, pairing each token with its
logprobs, and the choice's own finish reason (a stop string ends it before
the engine does) and stop reason (vLLM's: the stop string or stop token id
that ended it; None for EOS and length). As in vLLM, the EOS that ends an
output adds no text, and neither does a stop token that is a special token;
any other stop token's text is part of the output. A prompt-only choice
(completions' max_tokens 0 with echo) returns none of what the engine
generates: it ends, with "length", once the engine's first update came (by
then every prompt logprob has come too).
Must not know: HTTP, JSON shapes (each API's format.py renders a Piece), how updates arrive.
A streaming and a non-streaming request read the same pieces, so streamed
text always concatenates to the non-streamed text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.generation.detokenizer import Detokenizer
from server.generation.stop_strings import StopMatcher
from server.generation.tokenizer import Tokenizer
from server.worker.request_state import RequestState
from shared.logprobs import TokenLogprobs
from shared.vocabulary import FinishReason


@dataclass(slots=True)
class TokenEntry:
    """A generated token with its logprobs and where its text starts in the choice's text."""

    logprobs: TokenLogprobs
    text_offset: int


@dataclass(slots=True)
class Piece:
    text: str
    entries: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None  # set on the choice's last piece


class ChoiceOutput:
    def __init__(self, index: int, state: RequestState, tokenizer: Tokenizer, *, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False, eos_token_ids: tuple[int, ...] = (),
                 is_prompt_only: bool = False, prompt_state: RequestState | None = None):
        self.index = index
        self.state = state
        # Whose prompt logprobs this choice shows: its own, or (n > 1) those its prompt's first choice computed.
        self.prompt_state = prompt_state or state
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended the output
        self.stopped_by_string = False  # the worker must be told to stop (abort) this one
        self.num_tokens = 0  # output tokens consumed: the usage's completion tokens
        self._detokenizer = Detokenizer(tokenizer, state.prompt_token_ids)
        self._stop = StopMatcher(stop, include_stop_str_in_output)
        self._num_chars = 0  # detokenized characters so far, for text offsets
        self._tokenizer = tokenizer
        self._silent_stop_ids = set() if state.params.ignore_eos else set(eos_token_ids)  # end without text
        self._is_prompt_only = is_prompt_only

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def advance(self) -> Piece | None:
        """What the engine produced since the last call, as text; None when there is nothing to send."""
        if self.is_finished:
            return None
        if self._is_prompt_only:
            return self._finish_prompt_only()
        token_ids, logprobs = self.state.output_token_ids, self.state.logprobs
        texts: list[str] = []
        entries: list[TokenEntry] = []
        while self.num_tokens < len(token_ids) and not self.is_finished:
            i = self.num_tokens
            self.num_tokens += 1
            if i < len(logprobs):
                entries.append(TokenEntry(logprobs[i], self._num_chars))
            self._add_text(texts, "" if self._is_silent_final_token(i) else self._detokenizer.step(token_ids[i]))
        engine_reason = self.state.finish_reason
        if not self.is_finished and engine_reason is not None and self.num_tokens == len(token_ids):
            self._add_text(texts, self._detokenizer.flush())
            if not self.is_finished:
                texts.append(self._stop.flush())
                self.finish_reason = engine_reason
                self.stop_reason = self._stop_token_reason()
        text = "".join(texts)
        if not text and not entries and not self.is_finished:
            return None
        return Piece(text, entries, self.finish_reason)

    def _finish_prompt_only(self) -> Piece | None:
        """A prompt-only choice: its end, with no text, once the engine generated (or ended); else None."""
        if not self.state.output_token_ids and self.state.finish_reason is None:
            return None
        aborted = self.state.finish_reason == FinishReason.ABORT
        self.finish_reason = FinishReason.ABORT.value if aborted else FinishReason.LENGTH.value
        return Piece("", [], self.finish_reason)

    def _add_text(self, texts: list[str], piece: str) -> None:
        self._num_chars += len(piece)
        result = self._stop.feed(piece)
        texts.append(result.text)
        if result.stop is not None:
            self.finish_reason = FinishReason.STOP.value
            self.stop_reason = result.stop
            self.stopped_by_string = True

    def _is_silent_final_token(self, i: int) -> bool:
        """The EOS, or a special stop token, that ended the output: it adds no text (vLLM's behaviour)."""
        state = self.state
        if state.finish_reason != FinishReason.STOP or i != len(state.output_token_ids) - 1:
            return False
        token_id = state.output_token_ids[i]
        return token_id in self._silent_stop_ids or (token_id in state.params.stop_token_ids
                                                     and self._tokenizer.is_special(token_id))

    def _stop_token_reason(self) -> int | None:
        """The stop token id that ended the output (not EOS: vLLM reports None for it)."""
        state = self.state
        if state.finish_reason != FinishReason.STOP or not state.output_token_ids:
            return None
        last = state.output_token_ids[-1]
        return last if last in state.params.stop_token_ids and last not in self._silent_stop_ids else None
