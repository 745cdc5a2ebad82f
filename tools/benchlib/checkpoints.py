"""Random-weight Llama checkpoints of known shapes, in the Hugging Face layout, and tokenizers for them.

No model can be downloaded, so the benchmarks' models have random (seeded)
weights. write_checkpoint gives one that `python -m server` serves like any
Hugging Face checkpoint: the weights and a word-level tokenizer built, not
trained: three special tokens ("<unk>" 0, "<s>" 1, "</s>" 2), then
lower-case words in order of length (a..z, aa..zz, aaa...) until the
vocabulary has exactly vocab_size entries. Every id decodes to whole ASCII
characters, so each token a random model generates streams as its own
chunk: with byte tokens, a token that ends inside a UTF-8 character is held
back until the next completes it, and the gaps a benchmark times would be
the detokenizer's, not the server's. write_weights is the weights alone;
ensure_tokenizer gives a checkpoint without a tokenizer a byte-level BPE
trained on this Python's standard library (grammar masks as large as a real
tokenizer's).

Shapes: smollm-135m (hidden 576, 30 layers, 9 heads / 3 KV heads,
intermediate 1,536, tied embeddings; its real vocabulary is
SMOLLM_135M_VOCAB_SIZE), tiny-4l (hidden 256, 4 layers, 4 heads / 2 KV
heads, intermediate 688), whose per-step cost is mostly per-operator
overhead, and llama-3.2-1b (hidden 2048, 16 layers, 32 heads / 8 KV heads,
intermediate 8,192, tied embeddings; its real vocabulary is 128,256).
torch and transformers are imported only when weights are written.
"""

from __future__ import annotations

import glob
import itertools
import json
import string
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.vocabulary import TOKENIZER_FILE

if TYPE_CHECKING:
    import torch

SHAPES = {
    "smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=True),
    "tiny-4l": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=True),
}
SMOLLM_135M_VOCAB_SIZE = 49152
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def word_vocab(vocab_size: int) -> dict[str, int]:
    """Specials, then lower-case words in order of length, vocab_size entries in all."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise SystemExit(f"--vocab-size must be more than {len(SPECIAL_TOKENS)}")
    words = ("".join(letters) for length in itertools.count(1)
             for letters in itertools.product(string.ascii_lowercase, repeat=length))
    tokens = [*SPECIAL_TOKENS, *itertools.islice(words, vocab_size - len(SPECIAL_TOKENS))]
    return {token: token_id for token_id, token in enumerate(tokens)}


def write_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    tokenizer = Tokenizer(models.WordLevel(vocab=word_vocab(vocab_size), unk_token=SPECIAL_TOKENS[0]))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # decoding joins the words with spaces
    tokenizer.save(str(directory / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
              "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0], "model_max_length": max_length}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_weights(directory: Path, shape: str, vocab_size: int, dtype: torch.dtype, max_length: int, seed: int,
                  device: str = "cpu") -> None:
    """A Llama of SHAPES[shape] with random weights drawn from `seed` (on `device`), saved in `dtype`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], vocab_size=vocab_size, max_position_embeddings=max_length,
                         rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(directory)


def write_checkpoint(directory: Path, shape: str, vocab_size: int, dtype: torch.dtype, max_length: int,
                     seed: int, device: str = "cpu") -> None:
    """The weights, then the word-level tokenizer (last: a checkpoint with its tokenizer is whole)."""
    write_weights(directory, shape, vocab_size, dtype, max_length, seed, device)
    write_tokenizer(directory, vocab_size, max_length)


def ensure_tokenizer(path: Path, vocab_size: int) -> None:
    """Give a checkpoint without one a byte-level BPE of `vocab_size` ids, trained on the standard library."""
    if (path / TOKENIZER_FILE).exists():
        return
    started = time.perf_counter()
    files = sorted(glob.glob(f"{sysconfig.get_paths()['stdlib']}/**/*.py", recursive=True))
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((Path(f).read_text(encoding="utf-8", errors="replace") for f in files), trainer)
    tokenizer.save(str(path / TOKENIZER_FILE))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL_TOKENS[1],
                                                            "eos_token": SPECIAL_TOKENS[2]}))
    print(f"trained a {tokenizer.get_vocab_size()}-token byte-level BPE on {len(files)} standard library files "
          f"in {time.perf_counter() - started:.0f} s")
