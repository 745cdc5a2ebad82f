"""Resident memory of a process, read from /proc: what both processes report of themselves in /metrics.

Linux only; elsewhere resident_bytes() returns None (the metrics then say NaN).
"""

from __future__ import annotations

import os

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(pid: int | str = "self") -> int | None:
    """The process's resident set (private and shared pages mapped in it), in bytes; None when unreadable."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            fields = statm.read().split()
    except OSError:
        return None
    return int(fields[1]) * _PAGE_BYTES
