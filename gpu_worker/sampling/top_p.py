"""Top-p's cutoff: per row of probabilities, the probability of the least likely token the nucleus keeps.

Owns that search; filters.py applies it. The rule: in descending order a
token is kept while the tokens before it hold less than top_p (their sum,
accumulated in double as torch's cumsum does, rounded to float32), and the
most likely token always is; the cutoff is the last kept token's
probability, so ties with it are kept too.

On the CPU, float32 rows go to a C kernel (cpu_top_p.c), compiled on first
use (compiled_library.py), which finds the cutoff by bucketing the
row's bits instead of sorting it. Other devices, or a machine that cannot
build the kernel, take torch ops, the reference the kernel is tested
against: the row's TOP_P_CANDIDATES most likely tokens first (a partial
top-k), and a full sort only for the rows whose candidates hold less than
top_p.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.native.compiled_library import load_function_or_warn
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.sampling")

SOURCE = Path(__file__).with_name("cpu_top_p.c")
TOP_P_CANDIDATES = 256  # most nuclei of a trained model fit in its top few hundred tokens
Kernel = Callable[..., int]  # pagedserve_top_p_cutoff, its argument types set
STATUS_NO_MEMORY = 2  # cpu_top_p.c's status when a thread's scratch row could not be allocated


def top_p_cutoff(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: [num_rows, vocab] (rows summing to 1); top_p: [num_rows, 1]. The cutoff of each row: [num_rows, 1]."""
    kernel = load_kernel()
    if kernel is not None and _kernel_takes(probs, top_p):
        return cutoff_on_cpu(kernel, probs, top_p)
    return cutoff_with_torch(probs, top_p)


def exclude_outside_nucleus(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """logits[r, v] = -inf where probs[r, v] is below row r's cutoff; in place. probs: softmax(logits)."""
    kernel = load_kernel()
    if (kernel is not None and _kernel_takes(probs, top_p) and logits.is_cpu and logits.dtype == torch.float32
            and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1] and logits.shape == probs.shape):
        cutoff_on_cpu(kernel, probs, top_p, logits)
    else:
        logits.masked_fill_(probs < cutoff_with_torch(probs, top_p), float("-inf"))


def _kernel_takes(probs: torch.Tensor, top_p: torch.Tensor) -> bool:
    return (probs.is_cpu and probs.dtype == torch.float32 and probs.stride(1) == 1
            and probs.stride(0) >= probs.shape[1] and top_p.dtype == torch.float32)


def cutoff_on_cpu(kernel: Kernel, probs: torch.Tensor, top_p: torch.Tensor,
                  logits: torch.Tensor | None = None) -> torch.Tensor:
    """The cutoffs, [num_rows, 1]; with `logits`, the tokens below them are set to -inf there too."""
    top_p = top_p.contiguous()
    cutoffs = torch.empty(probs.shape[0], 1, dtype=torch.float32)  # [num_rows, 1]
    status = kernel(probs.data_ptr(), probs.stride(0), probs.shape[0], probs.shape[1], top_p.data_ptr(),
                    cutoffs.data_ptr(), None if logits is None else logits.data_ptr(),
                    0 if logits is None else logits.stride(0), torch.get_num_threads())
    if status == STATUS_NO_MEMORY:
        raise MemoryError(f"the top-p kernel could not allocate its scratch rows for {tuple(probs.shape)}")
    if status:
        raise RuntimeError(f"the top-p kernel refused probabilities of {tuple(probs.shape)} (status {status})")
    return cutoffs


def cutoff_with_torch(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: a partial top-k of TOP_P_CANDIDATES, and a full sort of the rows it falls short for."""
    candidates = probs.topk(min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1).values  # [num_rows, num_candidates]
    cutoff, is_short = _cutoff_in_sorted(candidates, top_p)  # [num_rows, 1] each
    if is_short.any():
        short_index = is_short.squeeze(1).nonzero().squeeze(1)  # [num_short]
        sorted_probs = probs.index_select(0, short_index).sort(dim=-1, descending=True).values  # [num_short, vocab]
        cutoff[short_index] = _cutoff_in_sorted(sorted_probs, top_p.index_select(0, short_index))[0]
    return cutoff


def _cutoff_in_sorted(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From descending probabilities [num_rows, n]: the last kept one, and whether the n fall short of top_p."""
    cumulative = sorted_probs.cumsum(dim=-1)  # [num_rows, n], non-decreasing
    mass_above = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # [num_rows, n], starts at 0 < top_p
    # mass_above[:, 0] is 0, so a top_p of 0 in float32 would keep none: the most likely token is always kept.
    num_kept = (mass_above < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)  # [num_rows, 1]
    return sorted_probs.gather(1, num_kept - 1), cumulative[:, -1:] < top_p


@functools.cache
def load_kernel(tier: CpuTier | None = None) -> Kernel | None:
    """The kernel's build for the tier (this process's by default), once per tier; None if none loads."""
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    argtypes = [pointer, i64, i64, i64, pointer, pointer, pointer, i64, ctypes.c_int]
    return load_function_or_warn(SOURCE, "pagedserve_top_p_cutoff", argtypes, logger, "the CPU top-p kernel",
                                 "torch's sort", tier)
