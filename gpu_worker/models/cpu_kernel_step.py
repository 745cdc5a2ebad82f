"""A step's forward pass on the CPU as the C kernels' calls, built once per batch size and run from C.

Owns running a LlamaForCausalLM over a step of up to MAX_ROWS tokens when
every piece of its layers has a C kernel: projections by the linear kernel
(float32 TiledLinear, or QuantizedLinear's int8 and int4) in a float32
model, by the pair kernel (PairTiledLinear) or oneDNN's packed product
(PackedLinear, called as the model calls it) in a bfloat16 one, the fused
kernels' norms and rotary, the C decode attention. Knows nothing of
scheduling: the runner hands it a step's inputs, and runs the model itself
for larger steps and other models (cpu_kernel_step_build.py says which).

Why: at a small model's sizes a step is mostly Python. On the 4-layer test
model (hidden 256, AVX2), of a 16-sequence decode step's forward pass of
3.2-3.8 ms, the kernels took 1.9-2.1 ms; module calls, argument checks,
allocations and views the rest (BENCHMARKS.md, "A step as the kernels'
calls"). Larger steps gain less, but still gain: 12 prompts of 1,500 tokens
prefilled in 2,048-token steps took 0.875 s here against 0.945 s through the
model, whose every step allocates its activations afresh (page faults and
all).

How: the rows a step passes from op to op (the residual stream, the normed
rows, qkv, the attention output, gate_up, SiLU·up) live in buffers held here,
grown to the next power of two of the batch; for each batch size and kind of
step the calls of every layer are built on them once, as a KernelProgram
(kernel_program.py) that runs them in one C call instead of ~10 ctypes calls
a layer. A step binds only what it changes (the rotary rows, the attention
metadata, the KV slots) and runs the calls in the model's order, on the
model's arguments: its hidden states are the model's bit for bit. Attention
is the model's C kernels called directly: the decode kernel on decode rows,
the prefill kernel on prefill chunks' rows, both into one buffer, as the
model's paged_attention calls them; the KV write is the layer kernels'
write_kv (the model's, index_copy_, holds the same bytes). SiLU·up is
torch's where the model uses torch's (the x86-64 build), a Python call
between runs of C calls. While a profile runs, the runner uses the model,
whose ops the profile names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

import torch

from gpu_worker.attention.cpu_decode import CpuDecodeKernel
from gpu_worker.attention.cpu_prefill import CpuPrefillKernel
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.models import layers
from gpu_worker.models.cpu_fused import WRITE_KV_CACHES, CpuFusedKernels, takes_kv
from gpu_worker.models.cpu_linear import TiledLinear
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear
from gpu_worker.models.kernel_program import KernelCall, KernelProgram, KernelRefused, ProgramRunner
from gpu_worker.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from gpu_worker.models.packed_linear import PackedLinear
from gpu_worker.models.quantized_linear import QuantizedLinear

MAX_ROWS = 2048  # the largest step run here (the default token budget): its buffers hold this many rows at most
MAX_PROGRAMS = 128  # programs kept (a batch size's, for each kind of step); past it they are built again
STEP_DTYPES = (torch.float32, torch.bfloat16)  # the models' dtypes it runs
_BEFORE_ATTENTION = ("norm", "qkv_proj", "apply_rotary", "write_kv")
_AFTER_ATTENTION = ("o_proj", "post_attention_norm", "gate_up_proj", "silu_and_mul", "down_proj")
# A layer's calls in a step of decodes only, of decodes and prefill chunks, and of prefill chunks only.
DECODE_STEP = (*_BEFORE_ATTENTION, "decode_attention", *_AFTER_ATTENTION)
MIXED_STEP = (*_BEFORE_ATTENTION, "decode_attention", "prefill_attention", *_AFTER_ATTENTION)
PREFILL_STEP = (*_BEFORE_ATTENTION, "prefill_attention", *_AFTER_ATTENTION)
# An op bound anew each step: its call on the first layer's caches, and where the caches' pointers are in its
# arguments (None: the same call in every layer).
StepCall = tuple[str, KernelCall, slice | None]


@dataclass(slots=True)
class _Rows:
    """The rows the ops pass on, for `capacity` tokens: a batch of n uses the first n of each."""

    capacity: int
    residual: torch.Tensor  # [capacity, hidden_size]: the residual stream
    x: torch.Tensor  # [capacity, hidden_size]: a layer's normed input, then its MLP output
    qkv: torch.Tensor  # [capacity, q_size + 2 * kv_size]
    attention: torch.Tensor  # [capacity, num_heads, head_dim]
    gate_up: torch.Tensor  # [capacity, 2 * intermediate_size]; [capacity, 0] where the projection takes SiLU·up
    activation: torch.Tensor  # [capacity, intermediate_size]: SiLU(gate) * up


class _StepViews(NamedTuple):
    """A step's rows in the buffers: the first n of each, and qkv's parts as heads."""

    residual: torch.Tensor  # [n, hidden_size]
    x: torch.Tensor  # [n, hidden_size]
    qk: torch.Tensor  # [n, num_heads + num_kv_heads, head_dim]: q and k side by side, rotated by one call
    q: torch.Tensor  # [n, num_heads, head_dim]
    k: torch.Tensor  # [n, num_kv_heads, head_dim]
    v: torch.Tensor  # [n, num_kv_heads, head_dim]
    attention: torch.Tensor  # [n, num_heads, head_dim]


class CpuKernelStep:
    """The forward pass of one model for steps of up to MAX_ROWS tokens; `forward` is LlamaForCausalLM.forward."""

    def __init__(self, model: LlamaForCausalLM, fused: CpuFusedKernels, decode_kernel: CpuDecodeKernel,
                 prefill_kernel: CpuPrefillKernel | None, runner: ProgramRunner) -> None:
        self.model = model
        self.fused = fused
        self.decode_kernel = decode_kernel
        self.runner = runner
        self.layers = decoder_layers(model)
        # The fused SiLU·up kernel where the model's layers use it, else torch's ops, as they do.
        self.silu_kernel = self.layers[0].mlp.ops.silu_and_mul in (fused.silu_and_mul, fused.silu_and_mul_float32)
        # Every layer's SiLU·up taken in its gate and up projection: then no step writes gate_up's buffer.
        self.fuses_mlp_input = self.silu_kernel and all(
            isinstance(layer.mlp.gate_up_proj, TiledLinear) and layer.mlp.gate_up_proj.paired_halves
            for layer in self.layers)
        attention = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.q_size, self.kv_size, self.scale = attention.q_size, attention.kv_size, attention.scale
        self.intermediate_size = self.layers[0].mlp.intermediate_size
        self.hidden_size = model.model.norm.weight.shape[0]
        self.dtype = model.model.norm.weight.dtype  # the rows' (float32 or bfloat16), the model's
        # oneDNN's products are its own tensors, copied into the step's buffers; every other kernel writes in place.
        self.copies_products = any(type(projection) is PackedLinear for layer in self.layers
                                   for projection in projections(layer))
        self.prefill_kernel = prefill_kernel  # the model's C prefill kernel; without it, decodes only
        self._rows: _Rows | None = None
        self._views: dict[int, _StepViews] = {}  # by rows
        self.programs: dict[tuple[int, int, tuple[str, ...]], KernelProgram] = {}  # (rows, threads, layer order) ->

    def takes(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether the runner should run this step here rather than through the model: up to MAX_ROWS tokens; with
        prefill chunks only where the model's prefill attention is the C kernel and no projection's product is
        copied (oneDNN's, a bfloat16 model's where the CPU lacks the pair kernel: on a prefill chunk's rows that
        copy costs more than the module calls it saves, the default model through HTTP 0.955x with them here)."""
        return num_tokens <= MAX_ROWS and (not meta.prefill_seqs
                                           or (self.prefill_kernel is not None and not self.copies_products))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [n] int64, n <= MAX_ROWS -> final hidden states [n, hidden_size].

        The result is a buffer of this object's: the next forward overwrites it."""
        n = input_ids.shape[0]
        if n > MAX_ROWS:
            raise ValueError(f"a kernel step runs up to {MAX_ROWS} tokens, got {n}")
        residual, x, qk, q, k, v, attention_out = self._views_for(n)
        k_cache, v_cache = kv_caches[0]
        decodes, prefills = meta.decode_seqs, meta.prefill_seqs
        prefill_kernel = self.prefill_kernel
        if not (self.decode_kernel.accepts(q, attention_out, k_cache, v_cache)
                and takes_kv(k, v, k_cache, v_cache, meta.slot_mapping) and (prefill_kernel is not None or not prefills)):
            raise ValueError(f"the kernel step's attention and KV write do not take caches of "
                             f"{tuple(k_cache.shape)} {k_cache.dtype}" + (" or prefill chunks" if prefills else ""))
        cos, sin = self.model.model.rotary_emb(positions, x.dtype, meta.max_seq_len)  # each [n, head_dim]
        attends = {}  # this step's attention calls by op, on the first layer's caches
        if decodes:
            attends["decode_attention"] = self.decode_kernel.call(q, attention_out, k_cache, v_cache, meta, decodes,
                                                                  self.scale)
        if prefill_kernel is not None and prefills:
            attends["prefill_attention"] = prefill_kernel.call(q, attention_out, k_cache, v_cache, meta, prefills,
                                                               self.scale)
        step_calls: list[StepCall] = [
            ("apply_rotary", self.fused.apply_rotary_call(qk, cos, sin), None),
            ("write_kv", self.fused.write_kv_call(k, v, k_cache, v_cache, meta.slot_mapping), WRITE_KV_CACHES),
            *((op, (call.kernel, call.args), call.cache_arguments) for op, call in attends.items())]
        cache_pointers = [(k_cache.data_ptr(), v_cache.data_ptr()) for k_cache, v_cache in kv_caches]  # each layer's
        layer_order = DECODE_STEP if not prefills else MIXED_STEP if decodes else PREFILL_STEP
        program = self._program(n, layer_order, step_calls, cache_pointers)
        torch.index_select(self.model.model.embed_tokens.weight, 0, input_ids, out=residual)
        try:
            program.run()
        except KernelRefused as refused:
            if refused.op in attends:
                raise attends[refused.op].error(refused.status) from None
            raise ValueError(f"the kernel step's {refused.op}: the kernel refused its inputs, "
                             f"status {refused.status}") from None
        return x

    def _program(self, n: int, layer_order: tuple[str, ...], step_calls: list[StepCall],
                 cache_pointers: list[tuple[int, int]]) -> KernelProgram:
        """The program for steps of n rows of this kind (layer_order), bound to this step's calls."""
        key = (n, torch.get_num_threads(), layer_order)
        program = self.programs.get(key)
        if program is None:
            if len(self.programs) >= MAX_PROGRAMS:  # the views too: up to MAX_ROWS of them otherwise
                self.programs.clear()
                self._views.clear()
            step_ops = {op: call for op, call, _ in step_calls}  # bound to each layer's caches below
            program = self.programs[key] = KernelProgram(self.runner, self._calls(n, step_ops, layer_order))
        for op, call, at in step_calls:
            program.bind_each(op, call, at, cache_pointers)
        return program

    def _views_for(self, n: int) -> _StepViews:
        """The first n rows of the buffers, as a step's ops see them; the buffers grown to hold n rows first (the
        programs and views built on the old ones dropped)."""
        if self._rows is None or self._rows.capacity < n:
            self._rows = self._allocate(min(1 << max(n - 1, 0).bit_length(), MAX_ROWS))
            self.programs.clear()
            self._views.clear()
        views = self._views.get(n)
        if views is None:
            rows, qkv = self._rows, self._rows.qkv[:n]
            q_size, kv_size, head_dim = self.q_size, self.kv_size, self.head_dim
            views = self._views[n] = _StepViews(
                rows.residual[:n], rows.x[:n],
                qkv[:, :q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, head_dim),
                qkv[:, :q_size].view(n, self.num_heads, head_dim),
                qkv[:, q_size:q_size + kv_size].view(n, self.num_kv_heads, head_dim),
                qkv[:, q_size + kv_size:].view(n, self.num_kv_heads, head_dim), rows.attention[:n])
        return views

    def _allocate(self, capacity: int) -> _Rows:
        def rows(*shape: int) -> torch.Tensor:
            return torch.empty((capacity, *shape), dtype=self.dtype)

        return _Rows(capacity, rows(self.hidden_size), rows(self.hidden_size),
                     rows(self.q_size + 2 * self.kv_size), rows(self.num_heads, self.head_dim),
                     rows(0 if self.fuses_mlp_input else 2 * self.intermediate_size), rows(self.intermediate_size))

    def _mlp_input_calls(self, mlp: LlamaMLP, x: torch.Tensor, gate_up: torch.Tensor,
                         activation: torch.Tensor) -> dict[str, KernelCall]:
        """The MLP's gate and up projection and its SiLU·up into activation: one call where the projection is
        paired and SiLU·up the kernel's (the product takes it, bit for bit the same), else two."""
        projection = mlp.gate_up_proj
        if self.fuses_mlp_input:
            return {"gate_up_proj": cast(TiledLinear, projection).silu_and_mul_call(x, activation)}
        return {"gate_up_proj": _linear_call(projection, x, gate_up),
                "silu_and_mul": (self.fused.silu_and_mul_call(gate_up, activation) if self.silu_kernel
                                 else (_torch_silu_and_mul, (gate_up, activation)))}

    def _calls(self, n: int, step_ops: dict[str, KernelCall],
               layer_order: tuple[str, ...]) -> list[tuple[str, KernelCall]]:
        """A step's calls for n rows in the model's order on the model's tensors (llama.py), each layer's in
        layer_order, this step's own (step_ops, on the first layer's caches in every layer) among them, and the final
        norm."""
        rows = self._rows
        assert rows is not None
        residual, x, qkv = rows.residual[:n], rows.x[:n], rows.qkv[:n]
        attention_out, gate_up, activation = rows.attention[:n].view(n, self.q_size), rows.gate_up[:n], rows.activation[:n]
        calls = []
        for index, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
            layer_calls = {
                # The first layer norms the embeddings, which become the residual stream; later ones add first.
                "norm": (self.fused.rms_norm_call(residual, norm.weight, norm.eps, x) if index == 0
                         else self.fused.add_rms_norm_call(x, residual, norm.weight, norm.eps)),
                "qkv_proj": _linear_call(attention.qkv_proj, x, qkv),
                "o_proj": _linear_call(attention.o_proj, attention_out, x),
                "post_attention_norm": self.fused.add_rms_norm_call(x, residual, post_norm.weight, post_norm.eps),
                **self._mlp_input_calls(mlp, x, gate_up, activation),
                "down_proj": _linear_call(mlp.down_proj, activation, x),
                **step_ops}
            calls += [(op, layer_calls[op]) for op in layer_order if op in layer_calls]
        norm = self.model.model.norm
        calls.append(("norm", self.fused.add_rms_norm_call(x, residual, norm.weight, norm.eps)))
        return calls


def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]  # nn.ModuleList is not generic


def projections(layer: LlamaDecoderLayer) -> tuple[torch.nn.Module, ...]:
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _linear_call(linear: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> KernelCall:
    projection = cast(TiledLinear | QuantizedLinear | PairTiledLinear | PackedLinear, linear)  # each one checked
    return projection.kernel_call(x, out)


def _torch_silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> int:
    """SiLU·up by torch's ops, where the model's layers use them, as a call of the program (status 0)."""
    layers.silu_and_mul(gate_up, out=out)
    return 0
