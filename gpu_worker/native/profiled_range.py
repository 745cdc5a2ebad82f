"""Native kernels named in the worker's profile.

torch's profiler records torch operators; a C kernel called through ctypes is
invisible to it, and its time would be booked as the step's own. Each call
site asks `profiling()` (about 50 ns, the only cost when no profile runs) and,
while a profile runs, calls the kernel through `call_named`, inside a range
named for it (for example `pagedserve::linear`):

    status = call_named("pagedserve::linear", kernel, args) if profiling() else kernel(*args)

A context manager around every call would cost about 0.4 µs a call even with
no profile running, several hundred calls a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch._C._autograd import _profiler_enabled as profiling

__all__ = ["call_named", "profiling"]

_T = TypeVar("_T")


def call_named(name: str, function: Callable[..., _T], args: tuple) -> _T:
    """function(*args) inside a profile range named `name`."""
    with torch.profiler.record_function(name):
        return function(*args)
