"""Command-line flags for EngineConfig, shared by every entry point that starts an engine.

--model and --tokenizer take a directory or a Hugging Face id, which resolves
from the local Hugging Face cache (shared/model_source.py). A few of vLLM's
flags are accepted for what this engine always does (chunked prefill, no CUDA
graphs, the KV cache in the model's dtype), so that a vLLM command line starts
here unchanged; a value that asks for something else is a start-up error.
A flag that sets an EngineConfig field defaults to that field's default
(DEFAULTS): the dataclass is the one place a default is written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    INT4_GROUP_SIZE,
    QUANTIZATION_SCHEMES,
    TARGET_ITL_AUTO_FACTOR,
    EngineConfig,
    field_defaults,
    format_memory_size,
)
from shared.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from shared.model_source import DEFAULT_REVISION, resolve_model_dir

KV_CACHE_DTYPE = "auto"  # the one --kv-cache-dtype value: the KV cache is kept in the model's dtype
DEFAULTS = field_defaults(EngineConfig)  # every flag that sets an EngineConfig field defaults to the field's default


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face checkpoint: a directory, a GGUF file (model.gguf), or a Hugging Face id "
                            "(org/name) read from the local Hugging Face cache, never downloaded (default: the "
                            "embedded Shakespeare model, "
                            f"served as {DEFAULT_MODEL_NAME!r})")
    group.add_argument("--tokenizer", default=DEFAULTS["tokenizer"],
                       help="where the tokenizer (tokenizer.json, tokenizer_config.json, the chat template) is read "
                            "from, a directory or a Hugging Face id, when not the checkpoint's (default: --model)")
    group.add_argument("--revision", default=None,
                       help=f"the branch, tag or commit of a Hugging Face id --model (default: {DEFAULT_REVISION})")
    group.add_argument("--tokenizer-revision", default=None,
                       help=f"the branch, tag or commit of a Hugging Face id --tokenizer (default: {DEFAULT_REVISION})")
    group.add_argument("--download-dir", default=None,
                       help="the Hugging Face cache that Hugging Face ids are read from (default: $HF_HUB_CACHE, "
                            "else $HF_HOME/hub, else ~/.cache/huggingface/hub); nothing is downloaded into it")
    group.add_argument("--dtype", default=DEFAULTS["dtype"], choices=DTYPES + tuple(DTYPE_ALIASES),
                       help="weights and KV cache dtype; auto takes the checkpoint's")
    group.add_argument("--quantization", "-q", default=DEFAULTS["quantization"], choices=QUANTIZATION_SCHEMES,
                       help="quantize the linear weights at load, weight-only: the decoder's to int8 (one scale per "
                            "output channel) or int4 (one scale per channel and group of 32 inputs), the lm_head "
                            "to int8; activations and the embeddings keep --dtype (default: serve the weights as "
                            "they are)")
    group.add_argument("--device", default=DEFAULTS["device"], choices=DEVICES,
                       help="auto: cuda when torch sees a GPU, else cpu")
    group.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", default=DEFAULTS["kv_cache_memory"],
                       help=f"KV cache budget, e.g. 2GiB (default: {format_memory_size(DEFAULT_CPU_KV_CACHE_MEMORY)} "
                            "on CPU, see --gpu-memory-utilization)")
    group.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS["gpu_memory_utilization"],
                       help="CUDA: share of the memory left after the weights given to the KV cache")
    group.add_argument("--num-kv-blocks", type=int, default=DEFAULTS["num_kv_blocks"],
                       help="exact KV pool size in blocks (testing)")
    group.add_argument("--max-num-batched-tokens", type=int, default=DEFAULTS["max_num_batched_tokens"],
                       help="token budget per step")
    group.add_argument("--target-itl-ms", type=float, default=DEFAULTS["target_itl_ms"],
                       help="the longest a step that holds running streams may take, in ms: prompts are prefilled "
                            f"in chunks that fit it (default: {TARGET_ITL_AUTO_FACTOR:g}x the step time of the "
                            "running streams alone; 0: every step may fill --max-num-batched-tokens)")
    group.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"], help="most sequences in one step")
    group.add_argument("--max-model-len", type=int, default=DEFAULTS["max_model_len"],
                       help="longest prompt + output (default: model's)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=DEFAULTS["enable_prefix_caching"],
                       help="share the KV cache of a common prompt prefix between requests (default: "
                            f"{'on' if DEFAULTS['enable_prefix_caching'] else 'off'})")
    group.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed for requests that give none")
    group.add_argument("--cpu-threads", type=int, default=DEFAULTS["cpu_threads"],
                       help="the worker's compute threads on the CPU (default: $OMP_NUM_THREADS, else, of the CPUs "
                            "this process may use after its affinity mask and cgroup CPU quota, all of them, their "
                            "half or their quarter, whichever the model's steps run fastest on at start; with "
                            "fewer than 4 CPUs, all of them)")
    implied = parser.add_argument_group("accepted for vLLM command lines: what this engine always does")
    implied.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                         help="always on: a long prompt is prefilled in chunks within --max-num-batched-tokens "
                              "(--no-enable-chunked-prefill is refused)")
    implied.add_argument("--enforce-eager", action="store_true",
                         help="always so: the model runs eagerly, there are no CUDA graphs to disable")
    implied.add_argument("--kv-cache-dtype", default=KV_CACHE_DTYPE,
                         help=f"only {KV_CACHE_DTYPE!r}: the KV cache holds the model's dtype (--dtype)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe; a ValueError naming the cache searched for a Hugging Face id not in it,
    or naming an implied flag given a value this engine does not do."""
    check_implied_flags(args)
    model = resolve_model_dir(args.model, args.revision, args.download_dir) if args.model else str(DEFAULT_MODEL_DIR)
    tokenizer = (resolve_model_dir(args.tokenizer, args.tokenizer_revision, args.download_dir) if args.tokenizer
                 else None)
    check_quantization_fits(model, args.quantization)
    return EngineConfig(model=model, tokenizer=tokenizer, dtype=args.dtype, device=args.device,
                        block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                        num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                        cpu_threads=args.cpu_threads, target_itl_ms=args.target_itl_ms,
                        quantization=args.quantization)


def check_quantization_fits(model_dir: str, quantization: str | None) -> None:
    """A ValueError, before any worker starts, for --quantization int4 on a model whose linear layers' input widths
    are not whole groups of INT4_GROUP_SIZE (otherwise each worker would fail to load it in turn). A config.json
    that cannot be read is left to the worker's loader, whose error names what is wrong with it."""
    if quantization != "int4":
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        heads = config["num_attention_heads"]
        widths = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
                  "num_attention_heads x head_dim": heads * (config.get("head_dim") or config["hidden_size"] // heads)}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return
    uneven = {name: width for name, width in widths.items() if width % INT4_GROUP_SIZE}
    if uneven:
        raise ValueError(f"--quantization int4 quantizes groups of {INT4_GROUP_SIZE} inputs, and this model's "
                         + ", ".join(f"{name} {width}" for name, width in uneven.items())
                         + f" is not a multiple of {INT4_GROUP_SIZE}; use --quantization int8")


def check_implied_flags(args: argparse.Namespace) -> None:
    """A ValueError for a vLLM flag that asks for what this engine does not do."""
    if not args.enable_chunked_prefill:
        raise ValueError("--no-enable-chunked-prefill is not supported: prefill is always chunked here, within "
                         "--max-num-batched-tokens (raise it to prefill longer prompts in one step)")
    if args.kv_cache_dtype != KV_CACHE_DTYPE:
        raise ValueError(f"--kv-cache-dtype supports only {KV_CACHE_DTYPE!r} (the KV cache in the model's dtype, "
                         f"--dtype), got {args.kv_cache_dtype!r}")
