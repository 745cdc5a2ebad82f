"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Owns the layer stack and which checkpoint tensor fills which parameter. Does
not know how attention reads the cache: the paged attention function is
passed in (torch or Triton, same signature), and the per-row ops (norms,
SiLU * up, rotary) come as a LayerOps chosen once for the device
(layers.select_layer_ops). Module names mirror the
Hugging Face checkpoint (model.layers.N.self_attn.o_proj, ...), except that
q/k/v and gate/up are fused into one matmul each (qkv_proj, gate_up_proj);
`checkpoint_tensors()` maps every checkpoint name to the slice it fills.

The residual stream is carried between layers rather than added at the end
of each: a layer returns its MLP's output and the residual beside it, and
the next layer's input_layernorm (the final norm, after the last layer)
adds the two as it norms them, so the add and the norm are one op
(add_rms_norm), one pass over the rows where the ops are fused.
"""

from __future__ import annotations

from typing import Callable, cast

import torch
from torch import nn

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.cpu_linear import TiledLinear
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear
from gpu_worker.models.layers import LayerOps, RMSNorm, RotaryEmbedding, select_layer_ops

# paged_attention(q, k, v, k_cache, v_cache, meta, scale) -> [num_tokens, num_heads, head_dim]
AttentionFn = Callable[..., torch.Tensor]
KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
_FUSED_MODULES = ("qkv_proj", "gate_up_proj")  # filled from several checkpoint tensors each


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    """An uninitialised nn.Linear: its weights come from the checkpoint, so random init is wasted time.

    Its parameters are made empty, never initialised on the meta device as torch's skip_init would: the first
    initialiser run there imports torch._dynamo, seconds of every worker's start and restart."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)  # nn.Linear's own __init__ would initialise the weights it makes
    linear.in_features, linear.out_features = in_features, out_features
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
    linear.register_parameter("bias", nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
                              if bias else None)
    return linear


def _embedding(num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device) -> nn.Embedding:
    """An uninitialised nn.Embedding (its table comes from the checkpoint): given an empty table, nn.Embedding
    initialises nothing."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim, dtype=dtype, device=device))


def _fused_parts(prefix: str, fused: nn.Linear, parts: dict[str, int]) -> dict[str, torch.Tensor]:
    """Checkpoint names of a fused linear's row blocks (weight and bias) -> views of those rows."""
    views = {}
    for suffix in ("weight", "bias"):
        param = getattr(fused, suffix)
        if param is not None:
            for name, rows in zip(parts, param.split(list(parts.values()), dim=0)):
                views[f"{prefix}{name}.{suffix}"] = rows
    return views


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, ops: LayerOps, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.attention = attention
        hidden = config.hidden_size
        self.qkv_proj = _linear(hidden, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device)
        self.o_proj = _linear(self.q_size, hidden, config.o_proj_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side, so one rotary call turns both (in place, where the ops can).
        qk = self.ops.apply_rotary(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [num_tokens, num_heads | num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        out = self.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [num_tokens, hidden_size]

    def checkpoint_parts(self, prefix: str) -> dict[str, torch.Tensor]:
        return _fused_parts(prefix, self.qkv_proj, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size})


class LlamaMLP(nn.Module):
    PAIRED_HALVES = ("gate_up_proj",)  # its rows' halves are gate and up: a packed kernel may pair their columns

    def __init__(self, config: ModelConfig, ops: LayerOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))  # [num_tokens, hidden_size]

    def checkpoint_parts(self, prefix: str) -> dict[str, torch.Tensor]:
        size = self.intermediate_size
        return _fused_parts(prefix, self.gate_up_proj, {"gate_proj": size, "up_proj": size})


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, ops: LayerOps, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attention, ops, dtype, device)
        self.mlp = LlamaMLP(config, ops, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings, with residual None, for the first layer)
        -> (this layer's MLP output, the residual stream before it), each [num_tokens, hidden_size]."""
        x, residual_stream = self.input_layernorm(x, residual)  # a tensor from here on, also in the first layer
        x = self.self_attn(x, cos, sin, kv_cache, meta)  # [num_tokens, hidden_size]
        x, residual_stream = self.post_attention_layernorm(x, residual_stream)
        return self.mlp(x), residual_stream


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, ops: LayerOps, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention, ops, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(positions, x.dtype, meta.max_seq_len)  # each [num_tokens, head_dim]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual)[0]  # [num_tokens, hidden_size]


class LlamaForCausalLM(nn.Module):
    """One implementation for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints.

    ops: the per-row ops every layer calls; by default those select_layer_ops chooses for the device.
    """

    def __init__(self, config: ModelConfig, attention: AttentionFn, dtype: torch.dtype, device: torch.device,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.model = LlamaModel(config, attention, select_layer_ops(device.type) if ops is None else ops, dtype, device)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)
        if config.tie_word_embeddings:  # one parameter, filled from the checkpoint's embed_tokens.weight
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> final hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def compute_logits_and_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """compute_logits, and each row's argmax of the logits [num_rows] int64 where the LM head's kernel takes it
        as it writes them (the tiled float32 and pair bfloat16 kernels on the CPU); None elsewhere."""
        lm_head = self.lm_head
        if not isinstance(lm_head, TiledLinear | PairTiledLinear):
            return lm_head(hidden).float(), None
        logits, argmax = lm_head.forward_with_argmax(hidden)
        return logits.float(), argmax

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint must provide, by its Hugging Face name -> the parameter (or slice) it fills."""
        tensors: dict[str, torch.Tensor] = {name: param for name, param in self.named_parameters()
                                            if not any(f".{fused}." in name for fused in _FUSED_MODULES)}
        # ... and the fused ones, by the checkpoint tensors that fill their row blocks
        for index, module in enumerate(self.model.layers):
            layer = cast(LlamaDecoderLayer, module)  # all that LlamaModel puts in layers; nn.ModuleList is not generic
            prefix = f"model.layers.{index}."
            tensors.update(layer.self_attn.checkpoint_parts(prefix + "self_attn."))
            tensors.update(layer.mlp.checkpoint_parts(prefix + "mlp."))
        return tensors
