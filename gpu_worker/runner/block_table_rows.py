"""BlockTableRows: a step's block tables as one zero-padded int32 array, kept from one step to the next.

The attention reads each sequence's block table as a row of one array.
Built afresh every step (a padded Python list per sequence, then numpy
converting all of them), that was the largest part of a decode step's input
preparation, while from one step to the next the array barely changes. A
sequence's table only ever grows while it holds its blocks (BlockManager
appends to the list, and when it frees them gives the sequence a new one),
so a row needs writing only where the step puts another table object than
the step before, or a longer one, and then only its new entries. When many
rows moved (sequences finished or joined ahead of them), the array is
rebuilt at once.
"""

from __future__ import annotations

import operator

import numpy as np

REBUILD_FRACTION = 0.25  # rebuild the whole array once more than this share of its rows moved


class BlockTableRows:
    def __init__(self) -> None:
        self._array = np.zeros((0, 0), dtype=np.int32)  # entries past a row's table are 0
        # Per row of the array, every row ever written: the table object it was last written from, and how many of
        # that table's entries it holds.
        self._tables: list[list[int]] = []
        self._lengths: list[int] = []

    def rows(self, tables: list[list[int]]) -> np.ndarray:
        """[len(tables), width] int32, row i `tables[i]` padded with 0, width at least the longest table's. A view
        of the array kept here: valid until the next call."""
        lengths = list(map(len, tables))
        num_rows, width = len(tables), max(lengths)
        if num_rows > self._array.shape[0] or width > self._array.shape[1]:
            self._grow(num_rows, width)
        if len(self._tables) >= num_rows and all(map(operator.is_, tables, self._tables)):
            if lengths != self._lengths[:num_rows]:
                for row, (length, known) in enumerate(zip(lengths, self._lengths)):
                    if length != known:  # grown: its new entries
                        self._array[row, known:length] = tables[row][known:length]
        else:
            self._rewrite(tables, lengths)
        self._tables[:num_rows], self._lengths[:num_rows] = tables, lengths
        return self._array[:num_rows]

    def _rewrite(self, tables: list[list[int]], lengths: list[int]) -> None:
        num_known = len(self._tables)
        moved = {row for row, table in enumerate(tables) if row >= num_known or table is not self._tables[row]}
        if len(moved) > REBUILD_FRACTION * len(tables):
            width = self._array.shape[1]
            self._array[:len(tables)] = np.array([table + [0] * (width - len(table)) for table in tables],
                                                 dtype=np.int32)
            return
        for row, table in enumerate(tables):
            known = self._lengths[row] if row < num_known else 0
            if row in moved:
                self._array[row, :lengths[row]] = table
                self._array[row, lengths[row]:known] = 0
            elif lengths[row] != known:
                self._array[row, known:lengths[row]] = table[known:lengths[row]]

    def _grow(self, num_rows: int, width: int) -> None:
        """Room for `num_rows` rows of `width` entries (each doubling when it grows), the rows written so far kept."""
        old = self._array
        rows, columns = old.shape
        if num_rows > rows:
            rows = max(num_rows, 2 * rows, 8)
        if width > columns:
            columns = max(width, 2 * columns, 8)
        self._array = np.zeros((rows, columns), dtype=np.int32)
        self._array[:old.shape[0], :old.shape[1]] = old
