"""Write a random-weight Llama checkpoint that the server can serve, with a word-level tokenizer of its vocabulary.

The serving benchmarks need a model of a known shape that `python -m server`
loads like any Hugging Face checkpoint, detokenizing whatever ids it
generates. No model can be downloaded, so the weights are random (seeded)
and the tokenizer is built, not trained: three special tokens ("<unk>" 0,
"<s>" 1, "</s>" 2), then lower-case words in order of length (a..z, aa..zz,
aaa...) until the vocabulary has exactly --vocab-size entries. Every id
decodes to whole ASCII characters, so each token a random model generates
streams as its own chunk: with byte tokens, a token that ends inside a UTF-8
character is held back until the next completes it, and the gaps a
benchmark times would be the detokenizer's, not the server's.

    python tools/bench_checkpoint.py --shape smollm-135m --vocab-size 4096 --dtype bfloat16 /tmp/smollm-bf16
    python tools/bench_checkpoint.py --shape tiny-4l /tmp/tiny-4l
    python -m server --model /tmp/smollm-bf16 &
    python tools/bench_serving.py --model-dir /tmp/smollm-bf16 --num-requests 64 --max-concurrency 16 \
        --prompt-len 32 512 --output-len 16 256 --request-rate inf --ignore-eos

Shapes: smollm-135m (hidden 576, 30 layers, 9 heads / 3 KV heads,
intermediate 1,536, tied embeddings), tiny-4l (hidden 256, 4 layers,
4 heads / 2 KV heads, intermediate 688), whose per-step cost is mostly
per-operator overhead, and llama-3.2-1b (hidden 2048, 16 layers, 32 heads /
8 KV heads, intermediate 8,192, tied embeddings; its real vocabulary is
--vocab-size 128256). --device cuda draws the random weights on the GPU,
much faster for the large shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

SHAPES = {
    "smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, tie_word_embeddings=True),
    "tiny-4l": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=True),
}
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
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
              "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0], "model_max_length": max_length}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_checkpoint(directory: Path, shape: str, vocab_size: int, dtype: torch.dtype, max_length: int,
                     seed: int, device: str = "cpu") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], vocab_size=vocab_size, max_position_embeddings=max_length,
                         rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(directory)
    write_tokenizer(directory, vocab_size, max_length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write (created)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-length", type=int, default=2048, help="max_position_embeddings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the random weights are drawn")
    args = parser.parse_args()
    write_checkpoint(args.out, args.shape, args.vocab_size, getattr(torch, args.dtype), args.max_length, args.seed,
                     args.device)
    print(args.out)


if __name__ == "__main__":
    main()
