"""The roofline of a run: its FLOPs and bytes read, from the model shape and the workload, and the lower bound on its time.

Accounting (per request of p prompt tokens and o output tokens; the model
computes n = p + o - 1 tokens, the last output token is sampled, never fed
back):

- Matmul FLOPs: 2 x the per-token projection parameters (q, k, v, o, gate,
  up, down in every layer) for each of the n computed tokens, plus 2 x the
  lm_head for the o rows whose logits are sampled.
- Attention FLOPs: a token at position c (1-based) attends c keys: 4 x heads x
  head_dim x c per layer (QK^T and PV). Summed over positions 1..n.
- Weight bytes: every engine step reads every matmul weight once.
- KV bytes: each decode token at position c reads the K and V of its
  context, 2 x layers x kv_heads x head_dim x c x dtype bytes. Prefill
  attention reads the KV it has just written and is left out.

Bound: the run must do all its FLOPs and read all its bytes; with compute and
memory traffic overlapping perfectly it takes at least
max(FLOPs / matmul rate, bytes / bandwidth). That is a true lower bound for
any schedule, including steps that mix prefill chunks with decodes. Norms,
rotary, sampling and the embedding gather are not counted; prefix-cache
hits are not subtracted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The fields of a ModelConfig the accounting needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int

    @classmethod
    def of(cls, config, dtype_bytes: int) -> ModelShape:
        """From a gpu_worker ModelConfig (tied or not, the lm_head is one vocab x hidden matmul per sampled row)."""
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, config.vocab_size, dtype_bytes)

    @property
    def layer_parameters(self) -> int:
        """Matmul parameters of all decoder layers: attention projections and the gated MLP."""
        q_size, kv_size = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = 2 * self.hidden_size * q_size + 2 * self.hidden_size * kv_size
        return self.num_hidden_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    @property
    def lm_head_parameters(self) -> int:
        return self.vocab_size * self.hidden_size


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
            f"  matmul {self.matmul_rate / 1e9:8.1f} GFLOP/s ({dtype}, weights streamed)   "
            f"bandwidth {self.bandwidth / 1e9:6.1f} GB/s",
            f"  workload {self.workload.flops / 1e9:10.1f} GFLOP   {self.workload.bytes / 1e9:8.2f} GB "
            f"(weights {self.workload.weight_bytes / 1e9:.2f}, KV {self.workload.kv_bytes / 1e9:.2f})",
            f"  lower bound {self.bound_seconds:8.2f} s (by {bound}: FLOPs {self.compute_seconds:.2f} s, "
            f"bytes {self.memory_seconds:.2f} s)",
            f"  measured    {measured_seconds:8.2f} s   achieved {self.bound_seconds / measured_seconds:6.1%}",
        ])


def _sum_to(n: int) -> int:
    return n * (n + 1) // 2


def workload_cost(shape: ModelShape, requests: list[tuple[int, int]], num_steps: int) -> Workload:
    """FLOPs and bytes of (prompt tokens, output tokens) requests run in num_steps engine steps."""
    computed = [prompt + output - 1 for prompt, output in requests]
    sampled = sum(output for _, output in requests)
    attention_per_key = 4 * shape.num_attention_heads * shape.head_dim * shape.num_hidden_layers
    flops = (2 * shape.layer_parameters * sum(computed) + 2 * shape.lm_head_parameters * sampled
             + attention_per_key * sum(_sum_to(n) for n in computed))
    decode_positions = sum(_sum_to(n) - _sum_to(prompt) for n, (prompt, _) in zip(computed, requests))
    kv_per_position = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * shape.dtype_bytes
    weight_bytes = (shape.layer_parameters + shape.lm_head_parameters) * shape.dtype_bytes * num_steps
    return Workload(flops, weight_bytes, kv_per_position * decode_positions)


def min_num_steps(requests: list[tuple[int, int]], max_batch: int) -> int:
    """Fewest engine steps that can run the requests' decodes, max_batch at a time (prefill steps not counted)."""
    decodes = [output - 1 for _, output in requests]
    return max(max(decodes, default=0), math.ceil(sum(decodes) / max_batch))
