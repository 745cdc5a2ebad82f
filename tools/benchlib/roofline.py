"""The roofline of a run: its FLOPs and bytes read, from the model shape and the workload, and the lower bound on its time.

Accounting (per request of p prompt tokens and o output tokens; the model
computes n = p + o - 1 tokens, the last output token is sampled, never fed
back):

- Matmul FLOPs: 2 x the per-token projection parameters (q, k, v, o, gate,
  up, down in every layer) for each of the n computed tokens, plus 2 x the
  lm_head for the o rows whose logits are sampled.
- Attention FLOPs: a token at position c (1-based) attends c keys: 4 x heads x
  head_dim x c per layer (QK^T and PV). Summed over positions 1..n.
- Weight bytes: every engine step reads every matmul weight once; with
  --quantization the decoder's linears are read as 1 byte a weight (int8,
  plus a float32 scale per channel, left out) or 1/2 (int4) plus a float32
  scale per group of 32 (5/8 of a byte in all), and the lm_head as int8.
- KV bytes: each decode token at position c reads the K and V of its
  context, 2 x layers x kv_heads x head_dim x c x dtype bytes. Prefill
  attention reads the KV it has just written and is left out.

Bound: the run must do all its FLOPs and read all its bytes; with compute and
memory traffic overlapping perfectly it takes at least
max(FLOPs / matmul rate, bytes / bandwidth). That is a true lower bound for
any schedule, including steps that mix prefill chunks with decodes. Norms,
rotary, sampling and the embedding gather are not counted; prefix-cache
hits are not subtracted.

format_roofline sets an HTTP load (token-id prompts) against this machine's
ceilings, measured when it is called (machine_limits.py, torch): after the
load, never during it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tools.benchlib.workload import BenchRequest


def layer_parameters(config) -> int:
    """Matmul parameters of all decoder layers of a gpu_worker ModelConfig: attention projections, gated MLP."""
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = 2 * config.hidden_size * q_size + 2 * config.hidden_size * kv_size
    return config.num_hidden_layers * (attention + 3 * config.hidden_size * config.intermediate_size)


def lm_head_parameters(config) -> int:
    """Tied or not, the lm_head is one vocab x hidden matmul per sampled row."""
    return config.vocab_size * config.hidden_size


@dataclass(slots=True, frozen=True)
class Workload:
    flops: int
    weight_bytes: int
    kv_bytes: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(slots=True, frozen=True)
class Roofline:
    workload: Workload
    matmul_rate: float  # FLOP/s
    bandwidth: float  # bytes/s

    @property
    def compute_seconds(self) -> float:
        return self.workload.flops / self.matmul_rate

    @property
    def memory_seconds(self) -> float:
        return self.workload.bytes / self.bandwidth

    @property
    def bound_seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    def format(self, dtype: str, measured_seconds: float) -> str:
        bound = "FLOPs" if self.compute_seconds >= self.memory_seconds else "bytes"
        return "\n".join([
            "roofline:",
            f"  matmul {self.matmul_rate / 1e9:8.1f} GFLOP/s ({dtype}, weights streamed, best kernel)   "
            f"bandwidth {self.bandwidth / 1e9:6.1f} GB/s",
            f"  workload {self.workload.flops / 1e9:10.1f} GFLOP   {self.workload.bytes / 1e9:8.2f} GB "
            f"(weights {self.workload.weight_bytes / 1e9:.2f}, KV {self.workload.kv_bytes / 1e9:.2f})",
            f"  lower bound {self.bound_seconds:8.2f} s (by {bound}: FLOPs {self.compute_seconds:.2f} s, "
            f"bytes {self.memory_seconds:.2f} s)",
            f"  measured    {measured_seconds:8.2f} s   achieved {self.bound_seconds / measured_seconds:6.1%}",
        ])


def _sum_to(n: int) -> int:
    return n * (n + 1) // 2


QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 32}


def workload_cost(config, dtype_bytes: int, requests: list[tuple[int, int]], num_steps: int,
                  quantization: str | None = None) -> Workload:
    """FLOPs and bytes of (prompt tokens, output tokens) requests run in num_steps engine steps, by a model of
    that ModelConfig whose weights and KV cache hold dtype_bytes per value, its decoder's linears quantized under
    `quantization` (int8, int4) or not (None)."""
    computed = [prompt + output - 1 for prompt, output in requests]
    sampled = sum(output for _, output in requests)
    layers, lm_head = layer_parameters(config), lm_head_parameters(config)
    attention_per_key = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    flops = 2 * layers * sum(computed) + 2 * lm_head * sampled + attention_per_key * sum(_sum_to(n) for n in computed)
    decode_positions = sum(_sum_to(n) - _sum_to(prompt) for n, (prompt, _) in zip(computed, requests))
    kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    layer_bytes = dtype_bytes if quantization is None else QUANTIZED_BYTES_PER_WEIGHT[quantization]
    head_bytes = dtype_bytes if quantization is None else QUANTIZED_BYTES_PER_WEIGHT["int8"]
    weight_bytes = round((layers * layer_bytes + lm_head * head_bytes) * num_steps)
    return Workload(flops, weight_bytes, kv_per_position * decode_positions)


def min_num_steps(requests: list[tuple[int, int]], max_batch: int) -> int:
    """Fewest engine steps that can run the requests' decodes, max_batch at a time (prefill steps not counted)."""
    decodes = [output - 1 for _, output in requests]
    return max(max(decodes, default=0), math.ceil(sum(decodes) / max_batch))


def format_roofline(model_dir: Path, dtype: str, workload: list[BenchRequest], max_concurrency: int,
                    seconds: float, quantization: str | None = None) -> str:
    """An HTTP load's roofline, the server's steps unseen: the weights counted as read once per step of the fewest
    steps possible (every request's decodes, max_concurrency at a time). Imports torch, so it runs only after the
    load."""
    if not all(isinstance(r.prompt, list) for r in workload):
        return "roofline: skipped (text prompts: their token counts are the server's to know)"
    # isort: off
    from tools.benchlib.machine_limits import matmul_rate, memory_bandwidth  # first: it holds torch to $PAGEDSERVE_CPU_ISA's tier
    # isort: on
    import torch

    from gpu_worker.models.config import read_model_config
    from gpu_worker.models.dtype_policy import compute_dtype
    from shared.cpu_tier import current_tier

    config = read_model_config(model_dir)
    tier = current_tier()
    requested = dtype if dtype == "auto" else getattr(torch, dtype)
    torch_dtype = compute_dtype(requested, config.torch_dtype, torch.device("cpu"), tier).dtype  # as the server
    requests = [(len(r.prompt), r.max_tokens) for r in workload]
    cost = workload_cost(config, torch_dtype.itemsize, requests, min_num_steps(requests, max_concurrency),
                         quantization)
    roofline = Roofline(cost, matmul_rate(torch_dtype), memory_bandwidth())
    weights = "" if quantization is None else f", weights {quantization}"
    return roofline.format(f"{str(torch_dtype).removeprefix('torch.')}{weights}, CPU tier {tier.name}", seconds)
