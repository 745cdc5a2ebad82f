"""The draw: the token each row picks from its logits, an exponential race for the sampled rows and the argmax
for the greedy ones.

Owns that last step of sampling. Row r draws argmax(logits[r] - log E[r]),
E its Exp(1) noise keyed by keys[r] (sampling/noise.py): with logits =
log p + c (excluded tokens at -inf) that draws token v with probability
p[v], and the token is a pure function of the row and its key.

On the CPU, float32 rows go to a C kernel (cpu_draw.c), which computes the
noise inside the race instead of in a dozen passes over [rows, vocab]
tensors and skips the tokens the filters excluded; rows that ask for
temperature and top_p alone go through those filters in the same call
(`filter_and_draw`), and greedy rows take its argmax (`greedy_tokens`,
torch's index exactly). Other devices, or a machine that cannot build the
kernel, take torch ops (`draw_with_torch`, filters.py), the reference the
kernel is tested against; the two agree except where two tokens' races, or
a token's mass above and top_p, end within a few ulp (the kernel's
logarithm and exponential differ there, as torch's own do between devices).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gpu_worker.native.compiled_library import load_function_or_warn, load_kernel_library
from gpu_worker.sampling.filters import filter_logits
from gpu_worker.sampling.noise import exponential_noise
from shared.cpu_tier import CpuTier, current_tier
from shared.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.worker.sampling")

SOURCE = Path(__file__).with_name("cpu_draw.c")
Kernel = Callable[..., int]  # pagedserve_draw or pagedserve_draw_filtered, its argument types set
STATUS_NO_MEMORY = 2  # cpu_draw.c's status when a thread's scratch rows could not be allocated
# The argmax kernel's vectors are 16 floats with AVX-512, else 8: two SSE registers on x86-64, where it ran at
# 0.30x torch's argmax (5-7x from avx2 up; BENCHMARKS.md).
ARGMAX_KERNEL_MIN_VECTOR_BITS = 256
_FLOAT32_TINY, _FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def filter_and_draw(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> torch.Tensor:
    """filter_logits, then the draw: [num_rows] int64. On the CPU, rows that ask for no filter but temperature
    and top_p go through both in one call of the kernel, which keeps a row in cache from its logits to its
    token (the torch ops and the separate draw cost 1.5-2 ms a step at 64 rows of a 4,096-token vocabulary)."""
    kernel = load_filtered_kernel()
    vocab_size = logits.shape[1]
    if (kernel is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1
            and all(p.min_p == 0 and (p.top_k is None or p.top_k >= vocab_size) for p in params)):
        return draw_filtered_on_cpu(kernel, logits, params, keys)
    return draw(filter_logits(logits, params), keys)


def draw_filtered_on_cpu(kernel: Kernel, logits: torch.Tensor, params: list[SamplingParams],
                         keys: list[int]) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    if len(keys) != num_rows or len(params) != num_rows:
        raise ValueError(f"expected parameters and a key for each of the {num_rows} rows, got {len(params)} and "
                         f"{len(keys)}")
    # As filter_logits: a temperature that is 0 or inf in float32 acts as the smallest or largest float32.
    temperature = np.array([min(max(p.temperature, _FLOAT32_TINY), _FLOAT32_MAX) for p in params], dtype=np.float32)
    top_p = np.array([p.top_p if p.top_p < 1 else np.inf for p in params], dtype=np.float32)  # inf: no top-p
    key_array = np.asarray(keys, dtype=np.uint64)
    tokens = torch.empty(num_rows, dtype=torch.int64)  # [num_rows]
    status = kernel(logits.data_ptr(), logits.stride(0) if num_rows else vocab_size, num_rows, vocab_size,
                    temperature.ctypes.data, top_p.ctypes.data, key_array.ctypes.data, tokens.data_ptr(),
                    torch.get_num_threads())
    if status == STATUS_NO_MEMORY:
        raise MemoryError(f"the draw kernel could not allocate its scratch rows for {tuple(logits.shape)}")
    if status:
        raise ValueError(f"the draw kernel refused logits of {tuple(logits.shape)} (status {status})")
    return tokens


@functools.cache
def _greedy_kernel() -> Kernel | None:
    """The argmax kernel, where this process's tier has vectors wide enough for it to beat torch's; once, as
    load_argmax_kernel() is (asking for the tier costs several microseconds, a step's greedy choice about 50)."""
    return load_argmax_kernel() if current_tier().vector_bits >= ARGMAX_KERNEL_MIN_VECTOR_BITS else None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, torch's to the index (the lowest on ties, NaN above all): [num_rows] int64. On a CPU with
    AVX2 or more a C kernel's one vectorised pass; torch's argmax takes about a nanosecond a logit there."""
    kernel = _greedy_kernel()
    if kernel is None or not (logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2
                              and logits.stride(1) == 1 and logits.shape[0] and logits.shape[1]):
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)  # [num_rows]
    if kernel(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], tokens.data_ptr(),
              torch.get_num_threads()):
        raise ValueError(f"the argmax kernel refused logits of {tuple(logits.shape)}")
    return tokens


def draw(logits: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """Exponential race: row r draws argmax(logits[r] - log E[r]), E keyed by keys[r]. [num_rows] int64.

    logits: [num_rows, vocab] float32 holding no NaN (filters.py's output).
    """
    kernel = load_kernel()
    if kernel is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1:
        return draw_on_cpu(kernel, logits, keys)
    return draw_with_torch(logits, keys)


def draw_with_torch(logits: torch.Tensor, keys: list[int]) -> torch.Tensor:
    noise = exponential_noise(keys, logits.shape[1], logits.device)  # [num_rows, vocab]
    return (logits - noise.log_()).argmax(dim=-1)  # [num_rows]


def draw_on_cpu(kernel: Kernel, logits: torch.Tensor, keys: list[int]) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    if len(keys) != num_rows:
        raise ValueError(f"expected a key for each of the {num_rows} rows, got {len(keys)}")
    key_array = np.asarray(keys, dtype=np.uint64)
    tokens = torch.empty(num_rows, dtype=torch.int64)  # [num_rows]
    status = kernel(logits.data_ptr(), logits.stride(0) if num_rows else vocab_size, num_rows, vocab_size,
                    key_array.ctypes.data, tokens.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError(f"the draw kernel refused logits of {tuple(logits.shape)} (status {status})")
    return tokens


def kernel_race_terms(keys: list[int], vocab_size: int, tier: CpuTier | None = None) -> torch.Tensor:
    """What the tier's kernel subtracts from each logit, log(E), written out: [len(keys), vocab_size] float32."""
    function = load_kernel_library(SOURCE, tier).pagedserve_draw_terms
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    key_array = np.asarray(keys, dtype=np.uint64)
    terms = torch.empty(len(keys), vocab_size, dtype=torch.float32)
    if function(key_array.ctypes.data, len(keys), vocab_size, terms.data_ptr()):
        raise ValueError(f"the draw kernel refused a vocabulary of {vocab_size}")
    return terms


@functools.cache
def load_argmax_kernel(tier: CpuTier | None = None) -> Kernel | None:
    """The kernel's argmax entry for the tier (this process's by default), once per tier; None if none loads."""
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    return load_function_or_warn(SOURCE, "pagedserve_argmax", [pointer, i64, i64, i64, pointer, ctypes.c_int], logger,
                                 "the CPU argmax kernel", "torch's argmax", tier)


@functools.cache
def load_filtered_kernel(tier: CpuTier | None = None) -> Kernel | None:
    """The kernel's filtering entry for the tier (this process's by default), once per tier; None if none loads."""
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    argtypes = [pointer, i64, i64, i64, pointer, pointer, pointer, pointer, ctypes.c_int]
    return load_function_or_warn(SOURCE, "pagedserve_draw_filtered", argtypes, logger, "the CPU draw kernel",
                                 "torch's filters, noise and argmax", tier)


@functools.cache
def load_kernel(tier: CpuTier | None = None) -> Kernel | None:
    """The kernel's build for the tier (this process's by default), once per tier; None if none loads."""
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    argtypes = [pointer, i64, i64, i64, pointer, pointer, ctypes.c_int]
    return load_function_or_warn(SOURCE, "pagedserve_draw", argtypes, logger, "the CPU draw kernel",
                                 "torch's noise and argmax", tier)
