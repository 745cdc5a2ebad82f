"""Quality cost of weight-only quantization: perplexity, KL divergence and top-1 agreement against float32.

Loads one checkpoint four ways, as the worker loads it (load_model): float32,
bfloat16, and --quantization int8 and int4 (quantized at load, float32
activations), and scores the same tokens with each, through the served
model's forward and the CPU's paged attention path (one sequence per
window, prefilled into a paged KV cache of the model's dtype). The text is
the model directory's eval/validation.json when it has one, else the
default model's (shared/default_model/eval/validation.json): each string
tokenized with the checkpoint's own tokenizer.json (the `tokenizers`
package, no special tokens) and followed by </s>, all concatenated into one
stream and cut into consecutive, non-overlapping windows of the model's
max_position_embeddings (--window to shorten them), the tail that does not
fill a window dropped. Each window is scored with input <s> + window[:-1]
and targets window, so every token is predicted: the protocol of
shared/default_model/MODEL.md, whose "first 16 windows" row is the float32
figure at the default --max-tokens 8192. A tokenizer that turns most of the
text into its unknown token (the word-level one of a checkpoint written by
bench_checkpoint.py) leaves nothing worth scoring: seeded random ids (from 3
up) are scored instead, and the perplexity columns are left out.

    python -m tools.bench.engine.bench_quality                                # the default model, 8,192 tokens
    python -m tools.bench.engine.bench_quality --schemes int8 --max-tokens 2048   # a quick look
    python -m tools.bench.engine.bench_checkpoint --shape smollm-135m --dtype float32 /tmp/ckpt/smollm-float32
    python -m tools.bench.engine.bench_quality --model-dir /tmp/ckpt/smollm-float32 --max-tokens 2048

How to read it: one line of context (torch, CPU tier, threads), one of the
tokens scored, then a row per variant. perplexity is exp(mean negative
log-likelihood of the targets), "vs float32" its change against float32's
(+0.4% is 0.4% higher, worse); it means something for a trained model only.
KL is the mean over positions of KL(float32 || variant) of the next-token
distributions, in nats: 0 for float32 itself, and the measure that holds
for random weights too. top-1 is the share of positions where the variant's
most likely token is float32's. tok/s is the variant's scoring rate
(prefill of the windows, logits included), for context only: on a
machine shared with other work it moves, the other columns do not. Under
int8 and int4 the lm_head is int8 and the embeddings keep float32
(quantized_linear.py), as the server quantizes them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

# isort: off
import gpu_worker  # noqa: F401 - before torch: under $PAGEDSERVE_CPU_ISA it holds torch to that tier
# isort: on
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from gpu_worker.attention import AttentionMetadata, select_paged_attention
from gpu_worker.kv.kv_cache import allocate_kv_cache
from gpu_worker.models import ModelConfig, load_model
from gpu_worker.models.config import read_model_config
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.native.cpu_threads import default_threads
from shared.config import QUANTIZATION_SCHEMES
from shared.cpu_tier import current_tier
from shared.vocabulary import TOKENIZER_FILE

DEFAULT_MODEL_DIR = Path("shared/default_model")
EVAL_TEXT = Path("eval") / "validation.json"
BLOCK_SIZE = 16
MIN_TOKEN_ID = 3  # random ids start past <unk>/<pad>, <s>, </s>
MAX_UNKNOWN_SHARE = 0.5  # a tokenizer that maps more of the text than this to its unknown token: random ids instead
REFERENCE = "float32"
WARM_UP_TOKENS = BLOCK_SIZE


@dataclass(slots=True)
class Variant:
    name: str  # float32, bfloat16, int8, int4
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    nll: float = 0.0  # summed over the scored tokens, nats
    kl: float = 0.0  # summed KL(float32 || this) over positions, nats
    agree: int = 0  # positions whose argmax is float32's
    seconds: float = 0.0
    load_seconds: float = 0.0


def load_variant(model_dir: Path, name: str, context: int) -> Variant:
    """The checkpoint as the worker loads it: `name` a dtype, or a quantization scheme over float32."""
    started = time.perf_counter()
    quantization = name if name in QUANTIZATION_SCHEMES else None
    dtype = "float32" if quantization else name
    model, config = load_model(model_dir, dtype=dtype, attention=select_paged_attention("cpu"),
                               quantization=quantization)
    model_dtype = next(model.parameters()).dtype  # as the worker sizes its KV cache
    num_blocks = -(-max(context, WARM_UP_TOKENS) // BLOCK_SIZE)
    kv_caches = allocate_kv_cache(config.num_hidden_layers, num_blocks, BLOCK_SIZE, config.num_key_value_heads,
                                  config.head_dim, model_dtype, torch.device("cpu"))
    variant = Variant(name, model, kv_caches, load_seconds=time.perf_counter() - started)
    log_probs(variant, torch.full((WARM_UP_TOKENS,), MIN_TOKEN_ID), prefill_metadata(WARM_UP_TOKENS))  # untimed:
    variant.seconds = 0.0  # threads, allocator and kernels warmed before the scoring is timed
    return variant


def prefill_metadata(length: int) -> AttentionMetadata:
    """One sequence of `length` new tokens and no cached ones, its blocks 0, 1, 2, ... in order."""
    num_blocks = -(-length // BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.arange(length, dtype=torch.int64),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).view(1, num_blocks),
        max_query_len=length,
        max_seq_len=length,
        query_lens_cpu=(length,),
        seq_lens_cpu=(length,),
    )


def log_probs(variant: Variant, inputs: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """inputs [length] -> float32 log-probabilities of every next token, [length, vocab]; times the forward."""
    started = time.perf_counter()
    with torch.inference_mode():
        hidden = variant.model(inputs, torch.arange(len(inputs)), variant.kv_caches, meta)  # [length, hidden]
        logits = variant.model.compute_logits(hidden)  # [length, vocab] float32
    variant.seconds += time.perf_counter() - started
    return logits.log_softmax(dim=-1)


def read_texts(path: Path) -> list[str]:
    """A JSON list of strings (one per document), or any other file as one plain-text document."""
    if path.suffix == ".json":
        texts = json.loads(path.read_text())
        if not (isinstance(texts, list) and all(isinstance(text, str) for text in texts)):
            raise SystemExit(f"{path}: expected a JSON list of strings")
        return texts
    return [path.read_text()]


def token_stream(model_dir: Path, text_path: Path, config: ModelConfig, limit: int,
                 seed: int) -> tuple[list[int], str]:
    """(at least `limit` token ids when the text has them, a description of where they come from)."""
    tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    stream: list[int] = []
    for text in read_texts(text_path):
        stream += tokenizer.encode(text, add_special_tokens=False).ids + ([eos] if eos is not None else [])
        if len(stream) >= limit:
            break
    unknown = _unknown_id(tokenizer)
    unknown_share = sum(token == unknown for token in stream) / max(len(stream), 1) if unknown is not None else 0.0
    if unknown_share <= MAX_UNKNOWN_SHARE:
        return stream, f"{text_path}, tokenized by {model_dir / TOKENIZER_FILE}"
    rng = random.Random(seed)
    ids = [rng.randrange(MIN_TOKEN_ID, config.vocab_size) for _ in range(limit)]
    return ids, (f"random ids {MIN_TOKEN_ID}..{config.vocab_size - 1} (seed {seed}): the tokenizer turns "
                 f"{unknown_share:.0%} of {text_path} into its unknown token")


def _unknown_id(tokenizer: Tokenizer) -> int | None:
    model = json.loads(tokenizer.to_str())["model"]
    return tokenizer.token_to_id(model["unk_token"]) if model.get("unk_token") else None


def windows_of(stream: list[int], window: int, limit: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens from the first `limit`, the partial tail dropped
    (unless it is all there is)."""
    stream = stream[:limit]
    if len(stream) < window:
        return [stream] if len(stream) >= 2 else []
    return [stream[start:start + window] for start in range(0, len(stream) - window + 1, window)]


def score(variants: list[Variant], windows: list[list[int]], bos: int) -> None:
    """Accumulate every variant's NLL, and its KL and top-1 agreement against variants[0] (float32)."""
    reference, *others = variants
    for window in windows:
        targets = torch.tensor(window)  # [length]
        inputs = torch.cat([torch.tensor([bos]), targets[:-1]])  # <s> + window[:-1]
        meta = prefill_metadata(len(window))
        ref = log_probs(reference, inputs, meta)  # [length, vocab]
        ref_top = ref.argmax(dim=-1)
        reference.nll -= ref.gather(1, targets[:, None]).sum().item()
        reference.agree += len(window)
        for variant in others:
            ours = log_probs(variant, inputs, meta)
            variant.nll -= ours.gather(1, targets[:, None]).sum().item()
            variant.kl += F.kl_div(ours, ref, reduction="sum", log_target=True).item()
            variant.agree += int((ours.argmax(dim=-1) == ref_top).sum().item())


def report(variants: list[Variant], num_tokens: int, with_perplexity: bool) -> None:
    reference = variants[0]
    ref_ppl = math.exp(reference.nll / num_tokens)
    header = f"{'variant':9s}"
    if with_perplexity:
        header += f" {'perplexity':>10s} {'vs float32':>10s}"
    print(header + f" {'KL nats':>10s} {'top-1':>7s} {'tok/s':>8s} {'load s':>7s}")
    for variant in variants:
        row = f"{variant.name:9s}"
        if with_perplexity:
            ppl = math.exp(variant.nll / num_tokens)
            row += f" {ppl:10.3f} {ppl / ref_ppl - 1:+10.2%}"
        print(row + f" {variant.kl / num_tokens:10.2e} {variant.agree / num_tokens:7.2%} "
                    f"{num_tokens / variant.seconds:8.0f} {variant.load_seconds:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--schemes", nargs="*", choices=QUANTIZATION_SCHEMES, default=list(QUANTIZATION_SCHEMES),
                        help="quantization schemes to compare with float32 (bfloat16 is always compared)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens scored, at most (whole windows)")
    parser.add_argument("--window", type=int, default=None,
                        help="tokens per window (default and ceiling: the model's max_position_embeddings)")
    parser.add_argument("--text", type=Path, default=None,
                        help=f"JSON list of strings or a text file (default: MODEL_DIR/{EVAL_TEXT}, else "
                             f"{DEFAULT_MODEL_DIR / EVAL_TEXT})")
    parser.add_argument("--seed", type=int, default=0, help="for the random ids, when the text is not used")
    args = parser.parse_args()

    torch.set_num_threads(default_threads())
    config = read_model_config(args.model_dir)
    if config.bos_token_id is None:
        raise SystemExit(f"{args.model_dir}: config.json names no bos_token_id, which every window starts with")
    context = config.max_context_len
    window = min(args.window or context, context)
    text = args.text or next((path for path in (args.model_dir / EVAL_TEXT, DEFAULT_MODEL_DIR / EVAL_TEXT)
                              if path.is_file()), None)
    if text is None:
        raise SystemExit(f"no text to score: pass --text (neither {args.model_dir / EVAL_TEXT} nor "
                         f"{DEFAULT_MODEL_DIR / EVAL_TEXT} exists)")
    stream, source = token_stream(args.model_dir, text, config, args.max_tokens, args.seed)
    windows = windows_of(stream, window, args.max_tokens)
    if not windows:
        raise SystemExit(f"{source}: fewer than 2 tokens to score")
    variants = [load_variant(args.model_dir, name, window) for name in (REFERENCE, "bfloat16", *args.schemes)]

    print(f"torch {torch.__version__}, CPU tier {current_tier().describe()}, {torch.get_num_threads()} threads; "
          f"model {args.model_dir} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, checkpoint {str(config.torch_dtype).removeprefix('torch.')}); "
          f"int8/int4 over float32 activations")
    num_tokens = sum(len(w) for w in windows)
    print(f"scored {num_tokens} tokens in {len(windows)} window(s) of {len(windows[0])}: {source}")
    score(variants, windows, config.bos_token_id)
    report(variants, num_tokens, with_perplexity=not source.startswith("random"))


if __name__ == "__main__":
    main()
