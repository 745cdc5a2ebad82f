"""The model's linear layers at the row counts the engine runs: F.linear, oneDNN packed weights and the tiled kernel
(in float32 from AVX2 up, gpu_worker/models/cpu_linear.py; in bfloat16 where it is native, the pair kernel of
gpu_worker/models/cpu_linear_bf16.py), against the machine's floor.

One "pass" is what a forward step's matmuls are: every layer's qkv, o,
gate_up and down projection (each layer its own weights, so they stream from
memory as in the model) and the lm_head, on an activation of M rows. Decode
steps run M = 1-64 (one row per running sequence), prefill chunks up to the
batched-token budget (2,048). For each M the two ways alternate, pass by
pass, and the median of each is printed as GFLOP/s, next to the machine's
matmul rates for the dtype (tools/benchlib/machine_limits.py) and the ratio. A third
way, the packed weights on the rows as they are, shows what padding the rows
to PackedLinear's ladder costs once both are compiled: a row count just past
a rung (17, 129, 1,025) pays the most, one on a rung nothing. Each way is
called as a plain function (PackedLinear.forward, not through nn.Module's
call), so the columns compare the work alone.

    python -m tools.bench.kernels.bench_linear                          # SmolLM-135M shape, float32 and bfloat16
    python -m tools.bench.kernels.bench_linear --model-dir CKPT --dtype bfloat16 --rows 16 256
    python -m tools.bench.kernels.bench_linear --model-dir CKPT --dtype bfloat16 --kernel-cache-bound 2048
    python -m tools.bench.kernels.bench_linear --quantized --rows 1 16 64 256   # int8 / int4 weights

--quantized measures instead the weight-only quantized layers (float32
activations) against the float32 tiled kernel: the tiled kernel on int8 and
int4 weights (quantized_linear.py), and torch's own int8 weight-only op
(`aten._weight_int8pack_mm`), each as GFLOP/s and as its share of its own
floor, which for a quantized pass counts its own, fewer, bytes.

--kernel-cache-bound N measures instead the memory oneDNN's kernel caches can
hold: each distinct linear shape is called once at every rung of the ladder
up to N rows, and the growth of malloc's bytes in use and of RSS is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_worker.models.config import ModelConfig, read_model_config
from gpu_worker.models.cpu_linear import TiledLinear, load_tiled_linear_kernel
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear, load_pair_linear_kernel
from gpu_worker.models.packed_linear import PackedLinear
from gpu_worker.models.quantization import quantize
from gpu_worker.models.quantized_linear import QuantizedLinear
from gpu_worker.native.row_ladder import ladder_rows
from gpu_worker.process.memory_report import malloc_in_use_bytes
from shared.cpu_tier import current_tier
from shared.process_memory import resident_bytes

from tools.benchlib.checkpoints import SHAPES, SMOLLM_135M_VOCAB_SIZE
from tools.benchlib.machine_limits import matmul_rates, memory_bandwidth


def linear_shapes(config: ModelConfig) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """[out, in] of one layer's four fused linears, and of the lm_head."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * config.intermediate_size, hidden), (hidden, config.intermediate_size)]
    return layer, (config.vocab_size, hidden)


def smollm_config() -> ModelConfig:
    shape = SHAPES["smollm-135m"]
    fields = {"vocab_size": SMOLLM_135M_VOCAB_SIZE, **{name: shape[name] for name in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}}
    return ModelConfig(architecture="LlamaForCausalLM", head_dim=fields["hidden_size"] // fields["num_attention_heads"],
                       **fields)


def tiled_layers(weights: list[torch.Tensor], dtype: torch.dtype) -> list[TiledLinear | PairTiledLinear]:
    """The weights as this tier's own kernels' layers: float32 TiledLinear from AVX2 up, bfloat16 PairTiledLinear
    where bfloat16 is native; none where the tier has no such kernel."""
    if dtype == torch.float32:
        kernel = load_tiled_linear_kernel(current_tier())
        return [] if kernel is None else [TiledLinear(kernel, w, None) for w in weights]
    pair_kernel = load_pair_linear_kernel(current_tier())
    return [] if pair_kernel is None else [PairTiledLinear(pair_kernel, w, None) for w in weights]


def compare(config: ModelConfig, dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    layer, lm_head = linear_shapes(config)
    shapes = [shape for _ in range(config.num_hidden_layers) for shape in layer] + [lm_head]
    weights = [torch.randn(shape).to(dtype) for shape in shapes]  # [out, in] each
    packed = [PackedLinear(w, None) for w in weights]
    tiled = tiled_layers(weights, dtype)
    rates, bandwidth = matmul_rates(dtype), memory_bandwidth()
    peak = max(rates.values())
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads: machine matmul rate "
          + ", ".join(f"{name} {rate / 1e9:.0f} GFLOP/s" for name, rate in rates.items())
          + f"; read {bandwidth / 1e9:.1f} GB/s; {weight_bytes / 2**20:.0f} MiB of weights a pass")
    columns = ["F.linear", "packed", *(["tiled"] if tiled else [])]
    print(f"{'rows':>6} {'floor':>7} " + " ".join(f"{name + ' GFLOP/s':>16}" for name in columns)
          + " " + " ".join(f"{name + ' / floor':>16}" for name in columns)
          + f" {'packed / F.linear':>18}" + (f" {'tiled / packed':>15}" if tiled else "")
          + f" {'padded to':>10} {'packed / unpadded':>18}")
    for m in rows:
        inputs = {shape[1]: torch.randn(m, shape[1]).to(dtype) for shape in shapes}
        flops = sum(2 * m * out * inp for out, inp in shapes)
        floor = flops / max(flops / peak, weight_bytes / bandwidth)
        ways = {
            "F.linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
            "packed": lambda: [p.forward(inputs[p.in_features]) for p in packed],
            "unpadded": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[p.in_features], p.packed_weight, None,
                                                                    "none", [], "") for p in packed],
        }
        if tiled:
            ways["tiled"] = lambda: [t.forward(inputs[t.in_features]) for t in tiled]
        times = _alternate(ways, repeats)
        rate = {name: flops / statistics.median(seconds) for name, seconds in times.items()}
        print(f"{m:>6} {floor / 1e9:>7.0f} " + " ".join(f"{rate[name] / 1e9:>16.0f}" for name in columns)
              + " " + " ".join(f"{rate[name] / floor:>16.0%}" for name in columns)
              + f" {rate['packed'] / rate['F.linear']:>17.2f}x"
              + (f" {rate['tiled'] / rate['packed']:>14.2f}x" if tiled else "")
              + f" {ladder_rows(m):>10} {rate['packed'] / rate['unpadded']:>17.2f}x")


def compare_quantized(config: ModelConfig, rows: list[int], repeats: int) -> None:
    kernel = load_tiled_linear_kernel(current_tier())
    if kernel is None:
        raise SystemExit(f"the tiled kernel has no build for this CPU tier ({current_tier().name})")
    layer, lm_head = linear_shapes(config)
    shapes = [shape for _ in range(config.num_hidden_layers) for shape in layer]  # the lm_head stays float
    weights = [torch.randn(shape) for shape in shapes]
    layers = {"float32": [TiledLinear(kernel, w, None) for w in weights],
              "int8": [QuantizedLinear(quantize(w, "int8"), None, kernel) for w in weights],
              "int4": [QuantizedLinear(quantize(w, "int4"), None, kernel) for w in weights]}
    torch_int8 = [quantize(w, "int8") for w in weights]
    weight_bytes = {name: sum(sum(t.nbytes for t in module.buffers()) for module in modules)
                    for name, modules in layers.items()}
    weight_bytes["torch int8"] = sum(q.q.nbytes + q.scales.nbytes for q in torch_int8)
    peak, bandwidth = max(matmul_rates(torch.float32).values()), memory_bandwidth()
    print(f"float32 activations, {torch.get_num_threads()} threads, decoder linears only: matmul {peak / 1e9:.0f} "
          f"GFLOP/s, read {bandwidth / 1e9:.1f} GB/s; weights "
          + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in weight_bytes.items()))
    names = list(weight_bytes)
    print(f"{'rows':>6} " + " ".join(f"{name + ' GFLOP/s':>19}" for name in names)
          + " " + " ".join(f"{name + ' / floor':>17}" for name in names))
    for m in rows:
        inputs = {shape[1]: torch.randn(m, shape[1]) for shape in shapes}
        flops = sum(2 * m * out * inp for out, inp in shapes)
        ways = {name: (lambda modules=modules: [layer.forward(inputs[layer.in_features]) for layer in modules])
                for name, modules in layers.items()}
        ways["torch int8"] = lambda: [torch.ops.aten._weight_int8pack_mm(inputs[q.q.shape[1]], q.q, q.scales)
                                      for q in torch_int8]
        times = _alternate(ways, repeats)
        rate = {name: flops / statistics.median(seconds) for name, seconds in times.items()}
        floor = {name: flops / max(flops / peak, weight_bytes[name] / bandwidth) for name in names}
        print(f"{m:>6} " + " ".join(f"{rate[name] / 1e9:>19.0f}" for name in names)
              + " " + " ".join(f"{rate[name] / floor[name]:>17.0%}" for name in names))


def _alternate(ways: dict, repeats: int) -> dict[str, list[float]]:
    """Each way's seconds over `repeats` passes, the ways taking turns in an order that turns each pass."""
    times = {name: [] for name in ways}
    order = list(ways.items())
    with torch.inference_mode():
        for _, work in order:
            work()
        for repeat in range(repeats):  # a way that follows another finds warm caches
            turn = repeat % len(order)
            for name, work in order[turn:] + order[:turn]:
                start = time.perf_counter()
                work()
                times[name].append(time.perf_counter() - start)
    return times


def kernel_cache_bound(config: ModelConfig, dtype: torch.dtype, max_rows: int) -> None:
    """Compile every rung's kernels for each distinct linear shape: the most the caches can hold."""
    layer, lm_head = linear_shapes(config)
    packed = [PackedLinear(torch.randn(shape).to(dtype), None) for shape in dict.fromkeys([*layer, lm_head])]
    rungs = sorted({ladder_rows(rows) for rows in range(1, max_rows + 1)})
    in_use, rss = malloc_in_use_bytes(), resident_bytes()
    with torch.inference_mode():
        for rows in rungs:
            for linear in packed:
                linear(torch.zeros(rows, linear.in_features, dtype=dtype))
    grown_in_use = "unknown" if in_use is None else f"{(malloc_in_use_bytes() - in_use) / 2**20:.0f} MiB"
    grown_rss = "unknown" if rss is None else f"{(resident_bytes() - rss) / 2**20:.0f} MiB"
    print(f"{str(dtype).removeprefix('torch.')}: {len(packed)} linear shapes x {len(rungs)} rungs up to {max_rows} "
          f"rows: malloc's bytes in use +{grown_in_use}, RSS +{grown_rss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="a checkpoint's shape (default: SmolLM-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), action="append", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quantized", action="store_true", help="measure int8 / int4 weights instead (float32 x)")
    parser.add_argument("--kernel-cache-bound", type=int, default=None, metavar="N",
                        help="measure the memory of every rung's kernels up to N rows instead")
    args = parser.parse_args()
    if args.kernel_cache_bound is not None and args.kernel_cache_bound < 1:
        parser.error(f"--kernel-cache-bound must be at least 1 row, got {args.kernel_cache_bound}")
    config = read_model_config(args.model_dir) if args.model_dir else smollm_config()
    if args.quantized:
        compare_quantized(config, args.rows, args.repeats)
        return
    for dtype in args.dtype or ["float32", "bfloat16"]:
        if args.kernel_cache_bound is not None:
            kernel_cache_bound(config, getattr(torch, dtype), args.kernel_cache_bound)
        else:
            compare(config, getattr(torch, dtype), args.rows, args.repeats)


if __name__ == "__main__":
    main()
