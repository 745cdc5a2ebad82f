"""The row ladder: the row counts the CPU's linear layers compute on, so that their compiled kernels stay few.

Owns the ladder's rungs: every row count up to EXACT_ROWS, then 2**LADDER_BITS
evenly spaced ones per doubling (18, 20, ..., 32, 36, ..., 64, 72, ...), 72 up
to 2,048 rows and 8 more per doubling beyond.
Must not know: torch, the model, the scheduler.
Why: oneDNN JIT-compiles a kernel for each number of rows a linear layer is
given and keeps it in two caches, oneDNN's primitive cache
($ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's ($LRU_CACHE_CAPACITY), each
of 1,024 entries by default and about 0.28 MB an entry whatever the weight's
size (measured: tools/bench/kernels/bench_linear.py --kernel-cache-bound). A server's
steps carry every number of tokens from 1 to --max-num-batched-tokens, so
unpadded the caches filled over hours, towards 570 MB, and a missed shape
costs 0.3-1.5 ms to compile again. PackedLinear pads its rows up to a rung
(`ladder_rows`), so the caches hold at most 72 entries per weight shape up to
2,048 rows, compiled once each, at the price of at most 1/8 more rows. The
latency target cuts a prefill chunk so that its step ends on a rung
(`rung_at_or_below`): padding there would be time the step-cost model does
not see.
"""

from __future__ import annotations

EXACT_ROWS = 16  # row counts up to this are rungs: decode batches of a few sequences pay nothing
LADDER_BITS = 3  # 2**LADDER_BITS rungs per doubling above EXACT_ROWS


def _spacing(rows: int) -> int:
    """The distance between rungs around `rows` (> EXACT_ROWS)."""
    return 1 << (rows.bit_length() - 1 - LADDER_BITS)


def ladder_rows(rows: int) -> int:
    """The rung `rows` is padded up to: itself up to EXACT_ROWS, above it the next of 8 evenly spaced rungs per
    doubling (17 -> 18, 100 -> 104, 2,049 -> 2,304), so at most 1/8 more."""
    if rows <= EXACT_ROWS:
        return rows
    spacing = _spacing(rows)
    return -(-rows // spacing) * spacing


def rung_at_or_below(rows: int) -> int:
    """The largest rung not above `rows` (37 -> 36, 2,049 -> 2,048): the rows a step may have without padding."""
    if rows <= EXACT_ROWS:
        return rows
    spacing = _spacing(rows)
    return rows // spacing * spacing
