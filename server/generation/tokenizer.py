"""Tokenizer: a checkpoint's tokenizer.json and tokenizer_config.json, as the frontend uses them.

Owns: text <-> token ids, the special tokens (bos, eos) and the
`add_bos_token` habit, the chat template source text if the config has one.
Must not know: HTTP, requests, the engine. Never imports torch or transformers.
How: tokenizers.Tokenizer does the work; encoding goes through its batch
call, which releases the GIL, so a thread can tokenize a long text while
the event loop goes on (the single-text call holds the GIL throughout). BOS: a tokenizer.json whose
post-processor adds it already does so on `add_special_tokens=True`; a config
that says `add_bos_token: true` gets it prepended when the post-processor did
not (SentencePiece-era checkpoints put it only there).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from shared.vocabulary import TOKENIZER_FILE

CONFIG_FILE = "tokenizer_config.json"
TOKEN_TEXT_CACHE_SIZE = 1 << 17  # token texts kept (a few MB at most)


def _token_text(value: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or {"content": ...} (AddedToken)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def token_starts(starts: list[int], is_added: list[bool], text_length: int) -> list[int]:
    """Where each token's text starts in a text of `text_length` characters, given the tokenizer's start offsets.

    A token the tokenizer added (BOS, by the post-processor or add_bos_token) holds none of the text: it starts
    where the text after it does (the next token's start, or the text's end). No start is before the one of the
    token before it (the bytes of one character, spread over several tokens, share its offsets)."""
    result = [0] * len(starts)
    following = text_length
    for i in reversed(range(len(starts))):
        if not is_added[i]:
            following = starts[i]
        result[i] = following
    for i in range(1, len(result)):
        result[i] = max(result[i], result[i - 1])
    return result


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict | None = None):
        config = config or {}
        self._tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template = config.get("chat_template")  # str, a list of {name, template}, or None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
        self._anchor = self._find_anchor()
        self._token_texts: dict[int, str] = {}  # token_text's, at most TOKEN_TEXT_CACHE_SIZE
        # No token spans more characters than its vocabulary entry: a text longer than n times this is over n tokens.
        self.max_token_chars = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a checkpoint directory; FileNotFoundError naming the file when it has no tokenizer.json."""
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"expected a tokenizer at {path}, found none")
        config_path = model_dir / CONFIG_FILE
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{config_path}: not a readable tokenizer config ({exc})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path}: not a readable tokenizer ({exc})") from None
        return cls(tokenizer, config)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what structured output's grammar engine reads)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encoding, bos = self._encoding(text, add_special_tokens)
        return encoding.ids if bos is None else [bos, *encoding.ids]

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """encode()'s ids, and where each token's text starts in `text` (token_starts' rules)."""
        encoding, bos = self._encoding(text, add_special_tokens)
        ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
        is_added = [bool(mask) for mask in encoding.special_tokens_mask]  # put there by the post-processor
        if bos is not None:
            ids, starts, is_added = [bos, *ids], [0, *starts], [True, *is_added]
        return ids, token_starts(starts, is_added, len(text))

    def _encoding(self, text: str, add_special_tokens: bool) -> tuple[tokenizers.Encoding, int | None]:
        """The tokenizer's encoding of `text`, and the BOS to put before it (add_bos_token, when the
        post-processor put none), else None."""
        [encoding] = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids, bos = encoding.ids, self.bos_token_id
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != bos):
            return encoding, bos
        return encoding, None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them (byte-level BPE's "Ġ" for a space included), as vLLM's
        /tokenize returns them with return_token_strs."""
        return [self._tokenizer.id_to_token(t) or "" for t in token_ids]

    def is_special(self, token_id: int) -> bool:
        """Whether the token is one of the tokenizer's special tokens (BOS, EOS, chat markers...)."""
        return token_id in self._special_ids

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it: as it reads inside a text (SentencePiece's "▁Romeo" is " Romeo",
        which decoding it alone strips), special tokens included, a partial character U+FFFD. Cached: logprobs
        ask for the same few tokens again and again."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._decode_in_context(token_id)
            if len(self._token_texts) < TOKEN_TEXT_CACHE_SIZE:
                self._token_texts[token_id] = text
        return text

    def _decode_in_context(self, token_id: int) -> str:
        """The token decoded after the anchor, the anchor's text cut off; alone for a special token, or where
        there is no anchor or it does not hold."""
        alone = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if self._anchor is None or token_id in self._special_ids:
            return alone
        anchor_id, anchor_text = self._anchor
        both = self._tokenizer.decode([anchor_id, token_id], skip_special_tokens=False)
        return both[len(anchor_text):] if both.startswith(anchor_text) else alone

    def _find_anchor(self) -> tuple[int, str] | None:
        """A token that decodes to one letter and keeps it in front of another token's text, so that a decoder
        that strips the text's first space (Llama 2's, Mistral's) strips none of the token after it."""
        ids = self._tokenizer.encode("a", add_special_tokens=False).ids
        if len(ids) != 1 or ids[0] in self._special_ids:
            return None
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if len(text) != 1 or not text.isalpha():
            return None
        return ids[0], text
