"""Write a random-weight Llama checkpoint that the server can serve, with a word-level tokenizer of its vocabulary.

The serving benchmarks need a model of a known shape that `python -m server`
loads like any Hugging Face checkpoint, detokenizing whatever ids it
generates: tools/benchlib/checkpoints.py writes it (the shapes, and why the
tokenizer is made of whole words, are described there).

    python -m tools.bench.engine.bench_checkpoint --shape smollm-135m --vocab-size 4096 --dtype bfloat16 /tmp/smollm-bf16
    python -m tools.bench.engine.bench_checkpoint --shape tiny-4l /tmp/tiny-4l
    python -m server --model /tmp/smollm-bf16 &
    python -m tools.bench.serving.bench_serving --model-dir /tmp/smollm-bf16 --num-requests 64 --max-concurrency 16 \
        --prompt-len 32 512 --output-len 16 256 --request-rate inf --ignore-eos

Shapes: smollm-135m, tiny-4l, llama-3.2-1b (its real vocabulary is
--vocab-size 128256). --device cuda draws the random weights on the GPU,
much faster for the large shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tools.benchlib.checkpoints import SHAPES, write_checkpoint


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
