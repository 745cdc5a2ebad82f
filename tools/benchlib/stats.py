"""percentile: the one definition every report in tools/ uses."""

from __future__ import annotations

import math


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0-100) of values, in any order: linear interpolation between closest ranks (numpy's
    default); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
