"""A tiny byte-level BPE tokenizer for test checkpoints, trained on the spot.

    from helpers.tiny_tokenizer import make_served_checkpoint, write_tokenizer
    path = make_served_checkpoint(tmp_path)   # make_checkpoint + tokenizer files
    write_tokenizer(existing_checkpoint_dir)  # or add one to a checkpoint

Ids agree with tests/helpers/checkpoints.py TINY: "<unk>" 0, "<s>" 1 (bos), "</s>" 2
(eos). Byte-level BPE covers every byte, so emoji and Chinese encode (as
several byte tokens) and random model output always decodes. Training is
deterministic for a fixed corpus and vocab size, and takes a few ms.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged attention server keeps the key "
    "and value cache in fixed-size blocks, so many requests share one GPU without waste.",
    "Once upon a time there was a small model that answered questions. It said hello to "
    "the user, counted one, two, three, four, five, and told a story about the sea.",
    "What is the capital of France? Paris is the capital of France. The weather today is "
    "sunny and warm; tomorrow it may rain. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.",
    "Emoji and other scripts: 😀 🎉 👍🏽 ❤️ — 你好，世界！我们今天学习中文。 Ünïcödé café naïve.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids on CORPUS."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"trained vocab has {tokenizer.get_vocab_size()} ids, expected <= {vocab_size}")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"special token {token!r} got id {tokenizer.token_to_id(token)}, expected {token_id}")
    return tokenizer


def write_tokenizer(checkpoint_dir: Path, vocab_size: int = 512) -> None:
    """Write tokenizer.json and tokenizer_config.json (bos/eos, chat_template) into checkpoint_dir."""
    checkpoint_dir = Path(checkpoint_dir)
    build_tokenizer(vocab_size).save(str(checkpoint_dir / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False, "model_max_length": 1024,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (checkpoint_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_served_checkpoint(tmp_path: Path, arch: str = "llama", **checkpoint_kwargs) -> Path:
    """make_checkpoint(tmp_path, arch, ...) plus a tokenizer, ready for the server."""
    from helpers.checkpoints import TINY, make_checkpoint

    path = make_checkpoint(tmp_path, arch, **checkpoint_kwargs)
    write_tokenizer(path, checkpoint_kwargs.get("vocab_size", TINY["vocab_size"]))
    return path
