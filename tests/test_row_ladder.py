"""The row ladder: the rungs PackedLinear pads a step's rows up to, and the rung the latency target cuts a step to."""

from __future__ import annotations

from gpu_worker.native.row_ladder import ladder_rows, rung_at_or_below

ROWS = range(1, 4097)


def test_ladder_pads_by_at_most_an_eighth_and_keeps_few_row_counts() -> None:
    padded = [ladder_rows(rows) for rows in ROWS]
    assert padded[:16] == list(range(1, 17))
    assert all(rows <= to <= rows + rows // 8 for rows, to in zip(ROWS, padded))
    assert padded == sorted(padded) and all(ladder_rows(to) == to for to in padded)
    assert len(set(padded[:2048])) == 72 and len(set(padded)) == 80


def test_the_rung_at_or_below_is_the_largest_rung_not_above() -> None:
    rungs = sorted({ladder_rows(rows) for rows in ROWS})
    for rows in ROWS:
        below = rung_at_or_below(rows)
        assert below == max(rung for rung in rungs if rung <= rows), rows
    assert [rung_at_or_below(rows) for rows in (16, 17, 37, 2049)] == [16, 16, 36, 2048]
