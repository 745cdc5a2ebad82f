"""A GGUF file's tokenizer metadata as Hugging Face tokenizer files: tokenizer.json and tokenizer_config.json.

Owns the conversion. A file that embeds its tokenizer.json
(`tokenizer.huggingface.json`) gets that one. Otherwise byte-level BPE
(`tokenizer.ggml.model` "gpt2": the tokens, their merges, and the
pre-tokenizer `tokenizer.ggml.pre` names) is rebuilt: the tokens in id order
are the vocabulary, control tokens become special added tokens and
user-defined ones plain added tokens. The pre-tokenizers served are the ones
whose splitting rule is known here (PRE_TOKENIZERS); SentencePiece
vocabularies ("llama") and other pre-tokenizers are refused by name, and
`--tokenizer` can name a Hugging Face tokenizer to use instead. BOS is not in
the tokenizer's post-processor: tokenizer_config.json's `add_bos_token`
(from `tokenizer.ggml.add_bos_token`) has the frontend prepend it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.gguf_model.metadata import GgufError

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, _byte_level(False)]}


# tokenizer.ggml.pre -> the pre-tokenizer of the Hugging Face tokenizers that llama.cpp names so
PRE_TOKENIZERS: dict[str, dict] = {
    "default": _byte_level(True),
    "gpt-2": _byte_level(True),
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                     _byte_level(True)]},
}
# pre-tokenizers whose Hugging Face tokenizers emit a word found whole in the vocabulary without merging it
_IGNORE_MERGES = {"llama-bpe", "llama3", "qwen2"}


def tokenizer_json(meta: dict[str, Any], path: Path) -> dict:
    """tokenizer.json's contents for the file's metadata; GgufError naming what is not served."""
    embedded = meta.get("tokenizer.huggingface.json")
    if embedded:
        return json.loads(embedded)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"{path}: tokenizer.ggml.model {kind!r} is not served (byte-level BPE, 'gpt2', is); give a "
                        f"Hugging Face tokenizer for this model with --tokenizer")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(f"{path}: tokenizer.ggml.pre {pre!r} is not served (served: {', '.join(PRE_TOKENIZERS)}); "
                        f"give a Hugging Face tokenizer for this model with --tokenizer")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": token_type == USER_DEFINED, "special": token_type == CONTROL}
             for i, (token, token_type) in enumerate(zip(tokens, types, strict=True))
             if token_type in (CONTROL, USER_DEFINED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre in _IGNORE_MERGES, "vocab": {token: i for i, token in enumerate(tokens)},
                  "merges": list(meta.get("tokenizer.ggml.merges") or [])},
    }


def tokenizer_config(meta: dict[str, Any]) -> dict:
    """tokenizer_config.json's contents: the special tokens by text, add_bos_token, the chat template."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {"bos_token": token("tokenizer.ggml.bos_token_id"),
                              "eos_token": token("tokenizer.ggml.eos_token_id"),
                              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    if token("tokenizer.ggml.padding_token_id"):
        config["pad_token"] = token("tokenizer.ggml.padding_token_id")
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config
