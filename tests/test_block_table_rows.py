"""BlockTableRows against the padded array built afresh, over steps whose sequences come, go, grow and are re-admitted."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpu_worker.runner.block_table_rows import BlockTableRows


def padded(tables: list[list[int]], width: int) -> np.ndarray:
    return np.array([table + [0] * (width - len(table)) for table in tables], dtype=np.int32).reshape(len(tables),
                                                                                                        width)


@pytest.mark.parametrize("seed", range(6))
def test_rows_are_the_tables_padded_with_zeros_at_every_step(seed: int) -> None:
    rng = random.Random(seed)
    rows = BlockTableRows()
    next_block = iter(range(1, 10**9))
    running: list[list[int]] = [[next(next_block)] for _ in range(rng.randint(1, 12))]
    for _ in range(400):
        event = rng.random()
        if event < 0.5:  # decodes: a few tables cross into a new block
            for table in rng.sample(running, k=rng.randint(0, len(running))):
                table.append(next(next_block))
        elif event < 0.6 and len(running) > 1:  # one finishes, from anywhere: the rows behind it move up
            running.pop(rng.randrange(len(running)))
        elif event < 0.7:  # one joins, with a prompt of several blocks
            running.insert(rng.randint(0, len(running)), [next(next_block) for _ in range(rng.randint(1, 40))])
        elif event < 0.8:  # one is preempted and re-admitted: its blocks freed, a new table as long as the old
            index = rng.randrange(len(running))
            running[index] = [next(next_block) for _ in running[index]]
        elif event < 0.9:  # the step holds only some of them
            step = rng.sample(running, k=rng.randint(1, len(running)))
            got = rows.rows(step)
            assert np.array_equal(got, padded(step, got.shape[1]))
            continue
        got = rows.rows(running)
        assert got.dtype == np.int32 and got.flags.c_contiguous
        assert got.shape[1] >= max(map(len, running))
        assert np.array_equal(got, padded(running, got.shape[1]))


def test_a_table_kept_from_the_step_before_is_not_written_again() -> None:
    rows = BlockTableRows()
    tables = [[1, 2], [3]]
    first = rows.rows(tables)
    first[0, 0] = 99  # what the array holds is only rewritten where a table changed
    tables[1].append(4)
    assert rows.rows(tables).tolist()[0][:2] == [99, 2]
    assert rows.rows(tables).tolist()[1][:2] == [3, 4]
