"""BlockManager: the pool of fixed-size KV cache blocks and each sequence's block table.

Owns which block ids are free and how many sequences reference each one. It
knows token counts, never tensors: the ModelRunner owns the cache memory and
reads/writes it by the block ids handed out here. A sequence's block table
grows one block at a time as its computed tokens cross block boundaries, and
all its references are dropped the moment it finishes, is aborted or is
preempted. A block returns to the free queue when its last reference goes.
"""

from __future__ import annotations

from collections import deque

from gpu_worker.sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens` more."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table so its next `num_new_tokens` tokens have slots."""
        num_missing = self.num_missing_blocks(seq, num_new_tokens)
        if num_missing > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.request_id} needs {num_missing} blocks, "
                               f"only {self.num_free_blocks} are free")
        for _ in range(num_missing):
            block_id = self._free_block_ids.popleft()
            self._ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference to each of its blocks; blocks no one references become free."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
