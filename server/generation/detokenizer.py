"""Incremental detokenization: one request's output token ids -> text pieces, as the tokens arrive.

Owns: turning each new token into the text it adds, without splitting a
UTF-8 character and without re-decoding the whole output every step.
Must not know: HTTP, stop strings, the engine.
How (two offsets into `token_ids`, as vLLM does): `prefix_offset` starts a
short window whose text has already been emitted up to `read_offset`. A new
token's text is decode(window + new) minus decode(window). Decoding a window
rather than one token keeps what depends on context (SentencePiece's leading
space, bytes of one character spread over several tokens) right. While the
new text ends in U+FFFD the last character is still incomplete: nothing is
emitted and the offsets stay, so the next token decodes together with it.
`flush()` at the end emits what is still held back (a character the model
never completed comes out as U+FFFD, as a whole decode would show it).
The window starts a few tokens back in the prompt so the first output token
decodes in context (without them if the prompt ends inside a character).
"""

from __future__ import annotations

from server.generation.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens the first window includes, for context-dependent decoding


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None):
        self._tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        if tokenizer.decode(self.token_ids).endswith(REPLACEMENT_CHAR):
            self.token_ids = []  # a prompt cut inside a character: its tail would change as output bytes join it
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def step(self, token_id: int) -> str:
        """Feed one new token; the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """The text still held back, at the end of the output."""
        if self.read_offset == len(self.token_ids):
            return ""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset:])
        if hold_incomplete and full_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = full_text[len(prefix_text):]
        del self.token_ids[:self.read_offset]  # the next window starts at this step's first token
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        return new_text
