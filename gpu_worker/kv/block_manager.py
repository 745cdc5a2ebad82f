"""BlockManager: the pool of fixed-size KV cache blocks and each sequence's block table.

Owns which block ids are free and how many sequences reference each one. It
knows token counts and token ids, never tensors: the ModelRunner owns the
cache memory and reads/writes it by the block ids handed out here. A
sequence's block table grows one block at a time as its tokens cross block
boundaries, and all its references are dropped the moment it finishes, is
aborted or is preempted. The table list is only ever appended to; freeing
gives the sequence a new one (the runner keeps a step's tables from the step
before on the strength of it: gpu_worker/runner/block_table_rows.py).

With prefix caching, every block that becomes full is registered under the
chained hash of its tokens; a new sequence starts from the longest run of
cached blocks that matches its tokens (sharing them, reference-counted) and
computes only the rest. A block whose last reference goes is parked with its
content for later hits; blocks are handed out from the never-used free
queue first, and only then by evicting the least recently used parked one.
`reset_prefix_cache` forgets every cached prefix at once (POST
/reset_prefix_cache): the parked blocks become free, and the blocks running
sequences hold stay theirs but are shared with no later one.

With a shared KV cache (`serials`, an int64 array in the shared segment, one
per block), every block handed out fresh is stamped with a new allocation
serial before its KV is written, and a successor worker can `adopt` a
request's blocks from a dead worker: only if each still carries the serial
the request's hold names (shared/kv_hold.py). An adopted block may still sit
in the free queue; it is marked claimed and skipped there rather than
searched for.

`audit_idle` is the accounting check the worker runs whenever it goes idle:
with no sequence left, every block must be free or parked in the prefix
cache.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gpu_worker.kv.prefix_cache import PrefixCache, hash_block
from gpu_worker.sequence import Sequence

_AUDIT_LISTED_IDS = 16  # block ids an audit failure names, at most


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 serials: np.ndarray | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._empty_pool(serials, enable_prefix_caching)

    def _empty_pool(self, serials: np.ndarray | None, enable_prefix_caching: bool) -> None:
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._free_block_ids: deque[int] = deque(range(self.num_blocks))  # never used, or holding nothing cached
        self._claimed: set[int] = set()  # adopted blocks still in _free_block_ids, skipped when reached
        self._ref_counts = [0] * self.num_blocks
        self.serials = serials  # the shared segment's allocation serials; None: a private cache
        self._next_serial: int | None = None  # read from the segment at the first allocation
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None

    def use_serials(self, serials: np.ndarray) -> None:
        """The pool now lives in a shared segment whose allocation serials are `serials`: stamp them from now on.
        Only while no block is referenced; what the prefix cache held is forgotten (the segment's blocks are not
        this pool's old ones)."""
        if self.audit_idle() is not None:
            raise RuntimeError("the KV pool moves to a shared segment only while no block is referenced")
        self._empty_pool(serials, self.prefix_cache is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references: never used, or parked in the prefix cache."""
        parked = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free_block_ids) - len(self._claimed) + parked

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence; a shared block counts once."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def acquire_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks matching its leading tokens.

        At most num_tokens - 1 tokens come from the cache: the last one is
        always computed, since its logits pick the next token. None while the
        sequence still needs prompt logprobs: they come from computing the prompt.
        """
        if self.prefix_cache is None or seq.block_table or seq.needs_prompt_logprobs:
            return
        num_full_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_block_hashes(seq, num_full_blocks)
        for block_id in self.prefix_cache.lookup(seq.block_hashes[:num_full_blocks]):
            if self._ref_counts[block_id] == 0:
                self.prefix_cache.unpark(block_id)
            self._ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's tokens and how many of them came from the cache."""
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_computed_tokens

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens` more."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def fits_next_token(self, seq: Sequence) -> bool:
        """Whether seq's next token has its slot in a block it holds and leaves that block short of full: a decode
        for which `allocate` would take no block and cache none (its block hashes are extended when next needed)."""
        position = seq.num_computed_tokens
        return position < len(seq.block_table) * self.block_size and (position + 1) % self.block_size != 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_missing = self.num_missing_blocks(seq, num_new_tokens)
        return num_missing == 0 or num_missing <= self.num_free_blocks  # most decodes need no block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table so its next `num_new_tokens` tokens have slots.

        Blocks that will be full once this step has run are registered in the
        prefix cache now: their KV is written in this step's forward pass
        before any layer's attention reads it, so a sequence admitted in the
        same step may already share them.
        """
        num_missing = self.num_missing_blocks(seq, num_new_tokens)
        if num_missing and num_missing > self.num_free_blocks:
            raise RuntimeError(f"sequence {seq.request_id} needs {num_missing} blocks, "
                               f"only {self.num_free_blocks} are free")
        for _ in range(num_missing):
            block_id = self._take_free_block()
            self._ref_counts[block_id] = 1
            if self.serials is not None:
                self._stamp(block_id)
            seq.block_table.append(block_id)
        if self.prefix_cache is not None:
            num_full_blocks = (seq.num_computed_tokens + num_new_tokens) // self.block_size
            self._extend_block_hashes(seq, num_full_blocks)
            for index in range(seq.num_computed_tokens // self.block_size, num_full_blocks):
                self.prefix_cache.insert(seq.block_table[index], seq.block_hashes[index])

    def _take_free_block(self) -> int:
        while self._free_block_ids:
            block_id = self._free_block_ids.popleft()
            if block_id not in self._claimed:
                return block_id
            self._claimed.discard(block_id)  # adopted and still referenced: it was never free
        if self.prefix_cache is None:
            raise RuntimeError("no free KV block left and no prefix cache to evict one from")
        return self.prefix_cache.evict()

    def _stamp(self, block_id: int) -> None:
        """Give a block handed out fresh a serial no earlier allocation of the segment has used."""
        if self.serials is None:
            raise RuntimeError("only a KV cache in the shared segment stamps its blocks with serials")
        if self._next_serial is None:
            self._next_serial = int(self.serials.max()) + 1
        self.serials[block_id] = self._next_serial
        self._next_serial += 1

    def adopt(self, seq: Sequence, block_ids: np.ndarray, serials: np.ndarray, num_computed: int) -> bool:
        """Give a sequence with no blocks the blocks a dead worker held for it, whose first `num_computed`
        positions hold its KV; with a prefix cache, its full ones become hits for later requests.

        False, and nothing taken, unless the cache is shared and every block is in range, still carries the
        serial it was reported with, and the blocks cover num_computed positions.
        """
        ids = block_ids[:num_blocks_for(num_computed, self.block_size)]
        if (self.serials is None or seq.block_table or not 0 < num_computed < seq.num_tokens
                or len(ids) < num_blocks_for(num_computed, self.block_size)
                or ids.min() < 0 or ids.max() >= self.num_blocks
                or not np.array_equal(self.serials[ids], serials[:len(ids)])):
            return False
        for block_id in ids.tolist():
            if self._ref_counts[block_id] == 0:
                if self.prefix_cache is not None and self.prefix_cache.is_parked(block_id):
                    self.prefix_cache.unpark(block_id)
                else:
                    self._claimed.add(block_id)
            self._ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = num_computed
        if self.prefix_cache is not None:
            num_full_blocks = num_computed // self.block_size
            self._extend_block_hashes(seq, num_full_blocks)
            for index in range(num_full_blocks):
                self.prefix_cache.insert(seq.block_table[index], seq.block_hashes[index])
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; the number of parked blocks this frees. A sequence's block_hashes stay
        (they depend on its tokens only); its blocks that are full already are not registered again."""
        if self.prefix_cache is None:
            return 0
        freed = self.prefix_cache.clear()
        self._free_block_ids.extend(freed)
        return len(freed)

    def audit_idle(self) -> str | None:
        """With no sequence alive, every block is free or parked in the prefix cache: None when so, else what is
        wrong. O(1) when all is well (the free count); the blocks still referenced are listed only on a failure."""
        if self.num_free_blocks == self.num_blocks and not self._claimed:
            return None
        held = [block_id for block_id, count in enumerate(self._ref_counts) if count]
        return (f"expected all {self.num_blocks} KV blocks free or held by the prefix cache at idle, got "
                f"{self.num_free_blocks} free; {len(held)} still referenced (ids {held[:_AUDIT_LISTED_IDS]}), "
                f"{len(self._claimed)} adopted blocks still claimed")

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference to each of its blocks; the last block first, so it is evicted first."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] != 0:
                continue
            if block_id in self._claimed:
                self._claimed.discard(block_id)  # still in the free queue, where it now counts again
            elif not (self.prefix_cache and self.prefix_cache.park(block_id)):
                self._free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _extend_block_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Hash seq's full blocks up to num_full_blocks; hashes depend only on tokens, so they are kept."""
        for index in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[index - 1] if index else None
            start = index * self.block_size
            seq.block_hashes.append(hash_block(parent, seq.token_ids(start, start + self.block_size)))
