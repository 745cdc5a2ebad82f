"""EchoedPrompt: a completion prompt as `echo` returns it: its text, its token ids, where each token's text starts.

Owns: the echoed text and the text offsets of the prompt's tokens in it, so that a client can cut the text at
any token (log-likelihood scoring finds where the continuation starts this way).
Must not know: HTTP, JSON shapes, the engine; where the work runs (PromptEncoder).
How: a text prompt is echoed as sent, its tokens' offsets the tokenizer's own (Tokenizer.encode_with_offsets).
A token id prompt is echoed as its decode with special tokens skipped (skip_special_tokens=true, the only value
this server takes), built piece by piece by the Detokenizer, so that each token's offset is where its piece
starts: a special token starts where the text after it does, and a token that ends inside a character starts
where that character will. Offsets never decrease.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.generation.detokenizer import Detokenizer
from server.generation.tokenizer import Tokenizer


@dataclass(slots=True, frozen=True)
class EchoedPrompt:
    text: str
    token_ids: list[int]
    text_offsets: list[int]  # where each token's text starts in `text`, one per token

    def token_strings(self, tokenizer: Tokenizer) -> list[str]:
        """Each token as logprobs list it: its stretch of the echoed text (up to the next token's offset), so that
        text[text_offset[i]:] starts with tokens[i]; a token with no stretch (a BOS, the first bytes of a character
        spread over several tokens) as the tokenizer spells it."""
        ends = [*self.text_offsets[1:], len(self.text)]
        return [self.text[start:end] or tokenizer.token_text(token_id)
                for token_id, start, end in zip(self.token_ids, self.text_offsets, ends)]


def decoded_prompt(tokenizer: Tokenizer, token_ids: list[int]) -> EchoedPrompt:
    """A token id prompt's text and offsets, by incremental decoding."""
    detokenizer = Detokenizer(tokenizer)
    pieces: list[str] = []
    offsets: list[int] = []
    num_chars = 0
    for token_id in token_ids:
        offsets.append(num_chars)
        piece = detokenizer.step(token_id)
        pieces.append(piece)
        num_chars += len(piece)
    pieces.append(detokenizer.flush())
    return EchoedPrompt("".join(pieces), list(token_ids), offsets)
