"""Command-line flags for EngineConfig, shared by every entry point that starts an engine."""

from __future__ import annotations

import argparse

from shared.config import DEVICES, DTYPE_ALIASES, DTYPES, EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="Hugging Face checkpoint directory (default: the embedded Shakespeare model, "
                            f"served as {DEFAULT_MODEL_NAME!r})")
    group.add_argument("--dtype", default="auto", choices=DTYPES + tuple(DTYPE_ALIASES),
                       help="weights and KV cache dtype; auto takes the checkpoint's")
    group.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when torch sees a GPU")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", default=None,
                       help="KV cache budget, e.g. 2GiB (default: 1GiB on CPU, see --gpu-memory-utilization)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: share of the memory left after the weights given to the KV cache")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks (testing)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    group.add_argument("--target-itl-ms", type=float, default=None,
                       help="the longest a step that holds running streams may take, in ms: prompts are prefilled "
                            "in chunks that fit it (default: 2.5x the step time of the running streams alone; "
                            "0: every step may fill --max-num-batched-tokens)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share the KV cache of a common prompt prefix between requests (default: on)")
    group.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="the worker's compute threads on the CPU (default: $OMP_NUM_THREADS, else the CPUs "
                            "this process may use after its affinity mask and cgroup CPU quota)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model or str(DEFAULT_MODEL_DIR), dtype=args.dtype, device=args.device,
                        block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                        num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                        cpu_threads=args.cpu_threads, target_itl_ms=args.target_itl_ms)
