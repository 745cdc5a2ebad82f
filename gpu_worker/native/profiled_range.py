"""A named range around a native kernel's call, in the worker's profile only.

torch's profiler records torch operators; a C kernel called through ctypes is
invisible to it, and its time would be booked as the step's own. While a
profile runs, each call is wrapped in a range named for its kernel (for
example `pagedserve::linear`); otherwise the check costs about 50 ns.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C._autograd import _profiler_enabled as _profiling

_NOT_PROFILING = contextlib.nullcontext()


def kernel_range(name: str) -> contextlib.AbstractContextManager:
    """`with kernel_range("pagedserve::linear"): ...` names the call in a running profile."""
    return torch.profiler.record_function(name) if _profiling() else _NOT_PROFILING
