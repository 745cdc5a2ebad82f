"""The per-row layer ops on the CPU: torch's reference ops vs candidates to replace them, side by side.

Same process, same inputs, at the shapes the engine runs: decode batches
of 1, 16 and 64 rows and prefill batches of 512 and 2048, float32 and
bfloat16, for the tiny-4l shape (hidden 256, 4/2 heads, intermediate 688)
and SmolLM-135M's (hidden 576, 9/3 heads, intermediate 1536), head_dim 64.
The candidates take turns (reference, each candidate, reference, ...):
each turn times a run of calls, and the printed figure is the median over
turns of reference time / candidate time (above 1: the candidate is
faster), with the reference's time per call.

    python -m tools.bench.kernels.bench_fused_ops                  # every op and case
    python -m tools.bench.kernels.bench_fused_ops --rows 1 16      # decode batches only
    python -m tools.bench.kernels.bench_fused_ops --model          # whole forward passes: the model on each set of ops
    python -m tools.bench.kernels.bench_fused_ops --mlp-input      # gate_up then SiLU·up, against packed in pairs

Candidates: "inplace", the same torch ops written in place (no new
tensors, the same dispatches); "c1", the C kernels of cpu_fused.py on the
calling thread; "cN", the C kernels on torch's threads. The model runs
"c1" below PARALLEL_MIN_ELEMENTS values and "cN" from there on. With
--model: one model on torch's ops, one on the C kernels (as the model
runs them), same random weights, packed linear layers as the loader packs
them; decode steps of 1, 16 and 64 sequences over 200 cached tokens, and a
512-token prefill.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata, select_paged_attention
from gpu_worker.models import layers
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.cpu_fused import PARALLEL_MIN_ELEMENTS, SOURCE, CpuFusedKernels
from gpu_worker.models.cpu_linear import TiledLinear, load_tiled_linear_kernel
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.packed_linear import pack_linears
from gpu_worker.native.compiled_library import load_kernel_library
from shared.cpu_tier import current_tier

SHAPES = {  # hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, num_layers, vocab_size
    "tiny-4l": (256, 4, 2, 64, 688, 4, 4096),
    "smollm-135m": (576, 9, 3, 64, 1536, 30, 49152),
}
OPS = ("add_rms_norm", "silu_and_mul", "apply_rotary")
EPS = 1e-5
TURN_SECONDS = 0.004  # a turn's run of calls lasts about this long: well above the timer's resolution
BLOCK_SIZE, CONTEXT = 16, 200
STEPS = ((1, 1), (16, 1), (64, 1), (1, 512))  # (sequences, new tokens each)


def add_rms_norm_inplace(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual.add_(x)
    return torch.mul(F.rms_norm(residual, residual.shape[-1:], eps=eps), weight, out=x), residual


def silu_and_mul_inplace(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # each [num_tokens, intermediate_size]
    return F.silu(gate).mul_(up)


def apply_rotary_inplace(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = qk.chunk(2, dim=-1)  # each [num_tokens, num_heads, head_dim // 2]
    rotated = torch.cat((-second, first), dim=-1).mul_(sin[:, None, :])  # [num_tokens, num_heads, head_dim]
    return qk.mul_(cos[:, None, :]).add_(rotated)


INPLACE_OPS = layers.LayerOps(rms_norm=layers.rms_norm, add_rms_norm=add_rms_norm_inplace,
                              silu_and_mul=silu_and_mul_inplace, apply_rotary=apply_rotary_inplace)


def op_calls(op: str, candidates: dict[str, layers.LayerOps], rows: int, shape: tuple[int, ...],
             dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """Each candidate's op as a call without arguments, on inputs of its own (the in-place ones overwrite theirs)."""
    hidden, num_heads, num_kv_heads, head_dim, intermediate = shape[:5]
    generator = torch.Generator().manual_seed(rows)
    calls = {}
    for name, ops in candidates.items():
        if op == "add_rms_norm":
            x, residual = (torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(2))
            weight = torch.rand(hidden, generator=generator).to(dtype) + 0.5
            calls[name] = lambda fn=ops.add_rms_norm, x=x, residual=residual, weight=weight: fn(x, residual, weight, EPS)
        elif op == "silu_and_mul":
            gate_up = torch.randn(rows, 2 * intermediate, generator=generator).to(dtype)
            calls[name] = lambda fn=ops.silu_and_mul, gate_up=gate_up: fn(gate_up)
        else:
            qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
            qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(rows, num_heads + num_kv_heads, head_dim)
            # Real angles: a rotation keeps the rows' size however often the in-place candidates turn them
            # (random factors would shrink them into subnormals, which are slow).
            rotary = layers.RotaryEmbedding(head_dim, 10000.0, None, torch.device("cpu"))
            cos, sin = rotary.compute(torch.arange(rows) * 3, dtype)  # each [rows, head_dim]
            calls[name] = lambda fn=ops.apply_rotary, qk=qk, cos=cos, sin=sin: fn(qk, cos, sin)
    return calls


def paired_ratios(calls: dict[str, Callable[[], object]], turns: int,
                  reference_name: str = "torch") -> tuple[float, dict[str, float]]:
    """(reference seconds per call, {candidate: median over turns of reference time / candidate time})."""
    for call in calls.values():
        call()  # warm up: first-touch allocations, the library's first call
    start = time.perf_counter()
    calls[reference_name]()
    per_turn = max(1, int(TURN_SECONDS / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(turns):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(per_turn):
                call()
            samples[name].append((time.perf_counter() - start) / per_turn)
    reference = samples.pop(reference_name)
    ratios = {name: statistics.median(r / c for r, c in zip(reference, times)) for name, times in samples.items()}
    return statistics.median(reference), ratios


def model_config(shape: tuple[int, ...]) -> ModelConfig:
    hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers, vocab = shape
    return ModelConfig("LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       head_dim=head_dim, rms_norm_eps=EPS, tie_word_embeddings=True)


def random_model(config: ModelConfig, dtype: torch.dtype, ops: layers.LayerOps) -> LlamaForCausalLM:
    """The same random weights on every call (seeded), linear layers packed as the loader packs them."""
    model = LlamaForCausalLM(config, select_paged_attention("cpu"), dtype, torch.device("cpu"), ops=ops)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02 + (1.0 if param.dim() == 1 else 0.0))
    pack_linears(model, current_tier())
    return model.requires_grad_(False).eval()


def step_call(model: LlamaForCausalLM, config: ModelConfig, num_seqs: int, num_new: int,
              dtype: torch.dtype) -> Callable[[], object]:
    """One forward of num_seqs sequences with CONTEXT cached tokens and num_new new ones, on a cache of its own."""
    context = 0 if num_new > 1 else CONTEXT
    blocks_each = -(-(context + num_new) // BLOCK_SIZE)
    positions = torch.arange(context, context + num_new).repeat(num_seqs)  # [num_seqs * num_new]
    tables = torch.arange(num_seqs * blocks_each, dtype=torch.int32).view(num_seqs, blocks_each)
    all_slots = tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)  # [num_seqs, blocks_each, BLOCK_SIZE]
    slots = all_slots.view(num_seqs, -1)[:, context:context + num_new]  # [num_seqs, num_new]
    meta = AttentionMetadata(slot_mapping=slots.reshape(-1), block_tables=tables,
                             query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * num_new,
                             seq_lens=torch.full((num_seqs,), context + num_new, dtype=torch.int32),
                             max_query_len=num_new, max_seq_len=context + num_new,
                             query_lens_cpu=(num_new,) * num_seqs, seq_lens_cpu=(context + num_new,) * num_seqs)
    cache_shape = (num_seqs * blocks_each, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.randn(cache_shape).to(dtype), torch.randn(cache_shape).to(dtype))
                 for _ in range(config.num_hidden_layers)]
    input_ids = torch.randint(3, config.vocab_size, (num_seqs * num_new,))

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids, positions, kv_caches, meta)
    return forward


def bench_ops(args: argparse.Namespace, library: ctypes.CDLL) -> None:
    candidates = {"torch": layers.TORCH_LAYER_OPS, "inplace": INPLACE_OPS,
                  "c1": CpuFusedKernels(library, parallel_min_elements=sys.maxsize).layer_ops(),
                  "cN": CpuFusedKernels(library, parallel_min_elements=0).layer_ops()}
    for shape_name in args.shapes:
        for op in args.ops:
            for dtype in (torch.float32, torch.bfloat16):
                for rows in args.rows:
                    calls = op_calls(op, candidates, rows, SHAPES[shape_name], dtype)
                    reference_s, ratios = paired_ratios(calls, args.turns)
                    shown = "  ".join(f"{name} x{ratio:5.2f}" for name, ratio in ratios.items())
                    print(f"{shape_name:11s} {op:12s} {str(dtype).removeprefix('torch.'):8s} rows {rows:5d}  "
                          f"torch {reference_s * 1e6:8.1f} us  {shown}", flush=True)


def bench_model(args: argparse.Namespace, library: ctypes.CDLL) -> None:
    kernels = CpuFusedKernels(library).layer_ops()
    for shape_name in args.shapes:
        config = model_config(SHAPES[shape_name])
        for dtype in (torch.float32, torch.bfloat16):
            models = {"torch": random_model(config, dtype, layers.TORCH_LAYER_OPS),
                      "c": random_model(config, dtype, kernels)}
            for num_seqs, num_new in STEPS:
                calls = {name: step_call(model, config, num_seqs, num_new, dtype) for name, model in models.items()}
                reference_s, ratios = paired_ratios(calls, args.turns)
                print(f"{shape_name:11s} {str(dtype).removeprefix('torch.'):8s} {num_seqs:3d} seqs x {num_new:3d} new  "
                      f"torch ops {reference_s * 1e3:8.2f} ms  c x{ratios['c']:5.3f}", flush=True)


def bench_mlp_input(args: argparse.Namespace, library: ctypes.CDLL) -> None:
    """float32: the gate and up projection into gate_up, then SiLU·up's kernel over it (two calls, the projection
    split between the threads by column tiles), against the projection packed in pairs taking SiLU·up from its
    registers (one call)."""
    linear_kernel = load_tiled_linear_kernel(current_tier())
    if linear_kernel is None:
        raise SystemExit(f"this tier ({current_tier().name}) has no float32 linear kernel")
    fused = CpuFusedKernels(library)
    for shape_name in args.shapes:
        hidden, intermediate = SHAPES[shape_name][0], SHAPES[shape_name][4]
        weight = torch.randn(2 * intermediate, hidden)  # [2 * intermediate, hidden]: gate's rows, then up's
        plain, paired = TiledLinear(linear_kernel, weight, None), TiledLinear(linear_kernel, weight, None, True)
        for rows in args.rows:
            x = torch.randn(rows, hidden)
            gate_up, activation = torch.empty(rows, 2 * intermediate), torch.empty(rows, intermediate)
            two_calls = (plain.kernel_call(x, gate_up), fused.silu_and_mul_call(gate_up, activation))
            one_call = paired.silu_and_mul_call(x, activation)
            calls = {"two calls": lambda: [kernel(*call_args) for kernel, call_args in two_calls],
                     "paired": lambda: one_call[0](*one_call[1])}
            reference_s, ratios = paired_ratios(calls, args.turns, reference_name="two calls")
            print(f"{shape_name:11s} gate_up + SiLU·up float32 rows {rows:5d}  two calls {reference_s * 1e6:8.1f} us  "
                  f"paired x{ratios['paired']:5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--turns", type=int, default=21)
    parser.add_argument("--model", action="store_true", help="time whole forward passes instead of single ops")
    parser.add_argument("--mlp-input", action="store_true",
                        help="time the MLP's gate and up projection and SiLU·up, as two calls and packed in pairs")
    args = parser.parse_args(argv)
    library = load_kernel_library(SOURCE)
    print(f"torch threads {torch.get_num_threads()}, PARALLEL_MIN_ELEMENTS {PARALLEL_MIN_ELEMENTS}, "
          f"median of {args.turns} paired turns; x = reference time / candidate time")
    (bench_model if args.model else bench_mlp_input if args.mlp_input else bench_ops)(args, library)


if __name__ == "__main__":
    main()
