"""Which models the kernel step (cpu_kernel_step.py) runs, and building it for one.

Owns the checks: a model on the CPU, float32 or bfloat16, whose every op is
one of the C kernels (projections by the linear kernels or oneDNN's packed
product, the fused norms and rotary, SiLU·up by its kernel or torch's, the C
decode attention). Knows nothing of how a step runs; the reason a model is
refused goes to the log (`steps: the model's forward pass (...)`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gpu_worker.attention.cpu_decode import CpuDecodeKernel, load_cpu_decode_kernel
from gpu_worker.attention.cpu_prefill import CpuPrefillKernel, load_cpu_prefill_kernel
from gpu_worker.attention.torch_paged import paged_attention
from gpu_worker.models import layers
from gpu_worker.models.cpu_fused import CpuFusedKernels, load_cpu_fused_kernels
from gpu_worker.models.cpu_kernel_step import MAX_ROWS, STEP_DTYPES, CpuKernelStep, decoder_layers, projections
from gpu_worker.models.cpu_linear import TiledLinear
from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear
from gpu_worker.models.kernel_program import load_program_runner
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.packed_linear import PackedLinear
from gpu_worker.models.quantized_linear import QuantizedLinear

logger = logging.getLogger("pagedserve.worker.models")


def build_cpu_kernel_step(model: LlamaForCausalLM) -> CpuKernelStep | None:
    """The kernel step for a model on the CPU whose every op has its C kernel, else None (the model runs every
    step itself). Logs which."""
    fused, decode_kernel, runner = load_cpu_fused_kernels(), load_cpu_decode_kernel(), load_program_runner()
    if fused is None or decode_kernel is None or runner is None:
        reason = "the CPU layer kernels, the decode attention kernel or the program runner did not load"
    else:
        reason = _unsupported(model, fused, decode_kernel)
    if reason is not None:
        logger.info("steps: the model's forward pass (%s)", reason)
        return None
    assert fused is not None and decode_kernel is not None and runner is not None
    logger.info("steps of up to %d tokens: the C kernels' calls, a program built once per batch size", MAX_ROWS)
    return CpuKernelStep(model, fused, decode_kernel, _c_prefill_kernel(model), runner)


def _c_prefill_kernel(model: LlamaForCausalLM) -> CpuPrefillKernel | None:
    """The C prefill kernel where the model's attention uses it for its prefill rows, else None."""
    kernel = load_cpu_prefill_kernel()
    keywords = getattr(decoder_layers(model)[0].self_attn.attention, "keywords", {})
    return kernel if kernel is not None and keywords.get("prefill") == kernel.prefill_attention else None


def _unsupported(model: LlamaForCausalLM, fused: CpuFusedKernels, decode_kernel: CpuDecodeKernel) -> str | None:
    """Why the kernel step cannot run this model on these kernels, or None when it can."""
    inner = model.model
    dtype = inner.norm.weight.dtype
    if dtype not in STEP_DTYPES or inner.norm.weight.device.type != "cpu":
        return f"{dtype} on {inner.norm.weight.device.type}: the step runs float32 or bfloat16 on the CPU"
    if inner.embed_tokens.max_norm is not None:
        return "an embedding with max_norm"
    decoders = decoder_layers(model)
    if decoders[0].self_attn.head_dim % 2:
        return "an odd head_dim, which the rotary kernel does not take"
    silu_ops = (fused.silu_and_mul, fused.silu_and_mul_float32, layers.silu_and_mul)
    for layer in decoders:
        attention, mlp = layer.self_attn, layer.mlp
        layer_projections = projections(layer)
        if not all(_has_kernel_call(p, dtype) for p in layer_projections):
            kinds = sorted({type(p).__name__ for p in layer_projections if not _has_kernel_call(p, dtype)})
            return f"{dtype} projections by {', '.join(kinds)}, not the linear kernel or oneDNN's packed product"
        ops = attention.ops
        if (ops.rms_norm, ops.add_rms_norm, ops.apply_rotary) != (fused.rms_norm, fused.add_rms_norm,
                                                                    fused.apply_rotary):
            return "layer ops other than the CPU layer kernels"
        if mlp.ops.silu_and_mul not in silu_ops or mlp.ops.silu_and_mul != decoders[0].mlp.ops.silu_and_mul:
            return "a SiLU·up other than the kernel's or torch's"
        if not _attends_with(attention.attention, decode_kernel):
            return "attention other than the C decode kernel"
    return None


def _attends_with(attention: Callable, decode_kernel: CpuDecodeKernel) -> bool:
    """Whether the layer's attention is the torch path with the C decode kernel for its decode rows."""
    func, keywords = getattr(attention, "func", None), getattr(attention, "keywords", {})
    return func is paged_attention and keywords.get("decode") == decode_kernel.decode_attention


def _has_kernel_call(projection: torch.nn.Module, dtype: torch.dtype) -> bool:
    """In a float32 model a tiled linear, or a quantized one on the same kernel (whose rows are float32); in a
    bfloat16 one the pair kernel's linear or oneDNN's packed product."""
    if dtype == torch.bfloat16:
        return type(projection) is PairTiledLinear or type(projection) is PackedLinear
    return type(projection) is TiledLinear or (type(projection) is QuantizedLinear and projection.kernel is not None)
