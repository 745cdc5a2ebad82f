"""RecyclePolicy: when a healthy worker is due to be replaced, and the figures the log gets."""

from __future__ import annotations

import pytest

from server.worker.recycling import CAUSE_MAX_REQUESTS, CAUSE_MEMORY, RecyclePolicy
from shared.protocol import EngineStats

MIB = 2**20


def stats(unexplained_mib: int, cuda_reserved_mib: int = 0) -> EngineStats:
    return EngineStats(rss_bytes=(unexplained_mib + 1030) * MIB, weights_bytes=3 * MIB, kv_cache_bytes=1024 * MIB,
                       allocator_cache_bytes=3 * MIB, unexplained_bytes=unexplained_mib * MIB,
                       cuda_allocated_bytes=cuda_reserved_mib * MIB // 2, cuda_reserved_bytes=cuda_reserved_mib * MIB)


def test_off_by_default():
    policy = RecyclePolicy()
    assert not policy.is_on and policy.due(stats(10**6), 10**9) is None


def test_memory_past_the_limit_is_due_with_its_figures():
    policy = RecyclePolicy(memory_limit=500 * MIB)
    assert policy.due(stats(500), 0) is None, "at the limit is not past it"
    cause, figures = policy.due(stats(533), 0)
    assert cause == CAUSE_MEMORY
    assert figures == ("its unexplained memory is 533 MiB, over the limit of 500 MiB (RSS 1563 MiB: weights 3, "
                       "KV cache 1024, malloc's cache 3)")


def test_cuda_reserved_memory_past_its_limit_is_due_with_its_figures():
    policy = RecyclePolicy(cuda_memory_limit=70 * 1024 * MIB)
    assert policy.is_on
    assert policy.due(stats(10**6, 70 * 1024), 0) is None, "the host-memory limit is not set, and at the limit is not past it"
    assert policy.due(stats(0, 72 * 1024), 0) == (
        CAUSE_MEMORY, "the CUDA memory reserved by torch's allocator is 73728 MiB, over the limit of 71680 MiB "
                      "(allocated 36864 MiB)")


def test_max_requests_is_due_once_reached():
    policy = RecyclePolicy(max_requests=50)
    assert policy.due(stats(0), 49) is None
    assert policy.due(stats(0), 50) == (CAUSE_MAX_REQUESTS, "it finished 50 requests (limit 50)")


@pytest.mark.parametrize("field, value", [("memory_limit", 0), ("cuda_memory_limit", 0), ("max_requests", 0),
                                          ("max_requests", -3)])
def test_a_limit_below_one_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RecyclePolicy(**{field: value})
