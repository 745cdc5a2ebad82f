"""The defaults of --standby-workers and --shared-kv-cache (server/worker/sharing.py)."""

from __future__ import annotations

from server.worker.sharing import available_memory, resolve_worker_sharing
from shared.default_model import DEFAULT_MODEL_DIR

MODEL = str(DEFAULT_MODEL_DIR)


def test_on_the_cpu_both_are_on_when_memory_allows():
    assert resolve_worker_sharing("cpu", MODEL, None, None, 64 << 30)[:2] == (1, True)


def test_no_standby_when_the_memory_available_would_not_hold_a_second_worker():
    standby, shared, why = resolve_worker_sharing("cpu", MODEL, None, None, 100 << 20)
    assert (standby, shared) == (0, True) and "100 MiB of memory available" in why


def test_on_cuda_neither_is_on_unless_asked():
    assert resolve_worker_sharing("cuda", MODEL, None, None, 64 << 30)[:2] == (0, False)
    assert resolve_worker_sharing("cuda", MODEL, 1, False, 64 << 30)[:2] == (1, False)


def test_what_is_asked_is_kept():
    assert resolve_worker_sharing("cpu", MODEL, 0, False, 64 << 30)[:2] == (0, False)


def test_this_machines_available_memory_is_read():
    available = available_memory()
    assert available is not None and 0 < available <= 1 << 50
