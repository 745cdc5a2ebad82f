"""Excluding from rows of logits the tokens a grammar's bitmask does not allow (-inf), in place.

Owns: the bitmask -> logits step of structured output (gpu_worker/sampling/grammar.py
fills the bitmasks). On the CPU, float32 logits go to a C kernel
(cpu_token_mask.c), compiled on first use (compiled_library.py), which skips
the words whose 32 tokens are all allowed: torch's masked_fill over the
unpacked bits costs about 2 ns a value there (tools/bench/engine/bench_offline.py
--workload json-schema measures the whole mask). Other devices and dtypes,
or a machine that cannot build the kernel, take torch ops: the bits
unpacked on the logits' device and a masked_fill, the reference the kernel
is tested against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gpu_worker.native.compiled_library import load_function_or_warn
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.sampling")

SOURCE = Path(__file__).with_name("cpu_token_mask.c")
_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a word: token 32 * word + i
Kernel = Callable[..., int]  # pagedserve_apply_token_bitmask, its argument types set


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """logits[rows[i], t] = -inf for every token t that bit t of bitmask[i] does not allow.

    logits: [num_rows, vocab]; bitmask: int32 [len(rows), ceil(vocab / 32)], llguidance's layout.
    """
    kernel = load_kernel()
    if kernel is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1:
        apply_on_cpu(kernel, logits, rows, bitmask)
    else:
        apply_with_torch(logits, rows, bitmask)


def apply_with_torch(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    num_rows, vocab_size = len(rows), logits.shape[1]
    words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)  # [num_rows, words]
    allowed = ((words.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).view(num_rows, -1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf")))


def apply_on_cpu(kernel: Kernel, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
    row_index = np.asarray(rows, dtype=np.int64)
    if len(rows) != bitmask.shape[0] or (row_index >= logits.shape[0]).any():
        raise ValueError(f"expected a bitmask row for each of the rows {rows} of {logits.shape[0]}, got "
                         f"{bitmask.shape[0]}")
    status = kernel(logits.data_ptr(), logits.stride(0), row_index.ctypes.data, len(rows), bitmask.ctypes.data,
                    bitmask.shape[1], logits.shape[1], torch.get_num_threads())
    if status:
        raise ValueError(f"the token mask kernel refused a bitmask of {bitmask.shape} for logits of "
                         f"{tuple(logits.shape)}")


@functools.cache
def load_kernel(tier: CpuTier | None = None) -> Kernel | None:
    """The kernel's build for the tier (this process's by default), once per tier; None if none loads."""
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    argtypes = [pointer, i64, pointer, i64, pointer, i64, i64, ctypes.c_int]
    return load_function_or_warn(SOURCE, "pagedserve_apply_token_bitmask", argtypes, logger,
                                 "the CPU token mask kernel", "torch's masked_fill", tier)
