"""PrefixCache: full KV blocks found by the chained hash of their tokens, and LRU eviction of unused ones.

A full block's hash covers its own token ids and its parent's hash, so equal
hashes mean equal whole prefixes (the only input to a block's KV here: one
model, no adapters). A block with no sequence referencing it keeps its hash
and content, parked in least-recently-used order, until a request hits it
or it is evicted to make room. Knows block ids and hashes; reference counts
and the never-used free blocks are the BlockManager's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK_HASH_BYTES = 16  # 128-bit: a collision would silently share the wrong KV


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block chained from its parent's hash (None for a sequence's first block)."""
    digest = hashlib.blake2b(parent_hash or b"", digest_size=BLOCK_HASH_BYTES)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class PrefixCache:
    def __init__(self) -> None:
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recent first
        self.num_evictions = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_by_hash)

    @property
    def cached_block_ids(self) -> set[int]:
        return set(self._hash_by_block)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Block ids of the longest run of leading hashes that are cached."""
        hits = []
        for block_hash in block_hashes:
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def insert(self, block_id: int, block_hash: bytes) -> None:
        """Remember a block that just became full; a hash already cached keeps its first block."""
        if block_hash not in self._block_by_hash:
            self._block_by_hash[block_hash] = block_id
            self._hash_by_block[block_id] = block_hash

    def park(self, block_id: int) -> bool:
        """The block's last reference went: keep it for later hits if it is cached. Returns whether it was."""
        if block_id not in self._hash_by_block:
            return False
        self._evictable[block_id] = None
        return True

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._evictable

    def unpark(self, block_id: int) -> None:
        """A parked block got a hit: it is referenced again and no longer evictable."""
        del self._evictable[block_id]

    def clear(self) -> list[int]:
        """Forget every cached prefix; returns the parked blocks, which nothing references now and are free.
        A block a sequence still holds keeps its KV for that sequence, but is found by no later lookup, and
        when its last reference goes it is not parked."""
        parked = list(self._evictable)
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        self._evictable.clear()
        return parked

    def evict(self) -> int:
        """Forget the least recently used parked block and hand its id out for reuse."""
        block_id, _ = self._evictable.popitem(last=False)
        self.num_evictions += 1
        del self._block_by_hash[self._hash_by_block.pop(block_id)]
        return block_id
