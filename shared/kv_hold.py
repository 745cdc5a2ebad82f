"""KVHold: what the frontend knows of a request's KV cache blocks, so that a new worker can adopt them.

With a shared KV cache (the pool lives in a shared-memory segment that
outlives any one worker, see server/worker/kv_segment.py), the worker reports after
each step, for each request it ran, how many of its positions now hold KV
(`num_computed`) and, when its block table changed, the table itself with the
allocation serial of each block. A serial is a number the worker writes into
the segment beside a block whenever it hands the block to a sequence; it
never repeats. When a worker dies, its successor is handed each request's
hold and adopts the blocks only if every block still carries the serial
reported: a block freed and handed to another request in a step whose report
never reached the frontend carries a newer one, and that request is then
recomputed instead of resumed from someone else's KV.

Positions below `num_computed` were written by steps that completed before
their report was sent; whatever the interrupted step wrote lies above it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.wire import BLOCK_ID_DTYPE, BLOCK_SERIAL_DTYPE, check_int


@dataclass(slots=True, eq=False)
class KVHold:
    """A request's blocks (in table order), their allocation serials, and how many positions hold good KV."""

    block_ids: np.ndarray  # int32 [num_blocks]
    serials: np.ndarray  # int64 [num_blocks]
    num_computed: int

    def __post_init__(self) -> None:
        self.block_ids = np.asarray(self.block_ids, dtype=BLOCK_ID_DTYPE)
        self.serials = np.asarray(self.serials, dtype=BLOCK_SERIAL_DTYPE)
        check_int("num_computed", self.num_computed)
        if self.block_ids.ndim != 1 or self.block_ids.shape != self.serials.shape:
            raise ValueError(f"a KV hold needs one serial per block, got {self.block_ids.shape} block ids and "
                             f"{self.serials.shape} serials")


@dataclass(slots=True, eq=False)
class KVProgress:
    """One request's KV after a step: `num_computed`, and its block table with their serials when the table
    changed (else both None). An empty table with num_computed 0: the request holds no blocks (it was preempted)."""

    request_id: str
    num_computed: int
    block_ids: np.ndarray | None = None  # int32
    serials: np.ndarray | None = None  # int64

    def __post_init__(self) -> None:
        check_int("num_computed", self.num_computed)
        if (self.block_ids is None) != (self.serials is None):
            raise ValueError("a changed block table comes with its serials")

    @classmethod
    def unchecked(cls, request_id: str, num_computed: int) -> KVProgress:
        """Progress with an unchanged table, built without __post_init__: for a decoder that checked its columns
        whole (most of a step's progress is this, one per running request)."""
        progress = object.__new__(cls)
        progress.request_id, progress.num_computed = request_id, num_computed
        progress.block_ids = progress.serials = None
        return progress

    @property
    def table(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The changed block table and its serials; None when the table did not change."""
        if self.block_ids is None and self.serials is None:
            return None
        if self.block_ids is None or self.serials is None:
            raise ValueError(f"the KV progress of {self.request_id} has a changed block table without its serials "
                             "or serials without a table")
        return self.block_ids, self.serials

    def apply_to(self, hold: KVHold | None) -> KVHold | None:
        """The request's hold after this progress (None: nothing known yet of its blocks)."""
        if (table := self.table) is not None:
            return KVHold(*table, self.num_computed)
        if hold is not None:
            hold.num_computed = self.num_computed
        return hold
