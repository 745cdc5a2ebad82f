"""Offline generation from the command line: the engine in-process, no server.

    python -m gpu_worker.engine.offline --model DIR --prompt "Once upon a time" --max-tokens 32
    python -m gpu_worker.engine.offline --model DIR --prompt-token-ids 1,450,4996 --temperature 0

Text prompts need the checkpoint's tokenizer.json; token ids work with any checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.engine_args import add_engine_arguments, engine_config_from_args
from shared.sampling_params import SamplingParams
from shared.vocabulary import TOKENIZER_FILE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.engine.offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="a text prompt (repeat for several)")
    prompt.add_argument("--prompt-token-ids", action="append", help="comma-separated token ids (repeatable)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=32)
    sampling.add_argument("--temperature", type=float, default=1.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    sampling.add_argument("--ignore-eos", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                seed=args.sampling_seed, ignore_eos=args.ignore_eos)
        config = engine_config_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokenizer = _load_tokenizer(Path(config.tokenizer_dir)) if args.prompt else None
    if args.prompt and tokenizer is None:
        print(f"error: {config.tokenizer_dir}/{TOKENIZER_FILE} is missing; pass --prompt-token-ids instead",
              file=sys.stderr)
        return 2
    prompts = ([tokenizer.encode(text).ids for text in args.prompt] if tokenizer
               else [[int(t) for t in ids.split(",")] for ids in args.prompt_token_ids])

    from gpu_worker.engine.engine import Engine
    from gpu_worker.engine.generate import generate

    engine = Engine(config)
    for completion in generate(engine, prompts, params):
        text = tokenizer.decode(completion.token_ids) if tokenizer else completion.token_ids
        print(f"[{completion.finish_reason}] {text}")
    return 0


def _load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = model_dir / TOKENIZER_FILE
    return Tokenizer.from_file(str(path)) if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
