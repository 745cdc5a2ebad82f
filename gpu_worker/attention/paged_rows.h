/*
 * The CPU attention kernels' walk over one kv head's rows of the paged KV cache: a cursor that turns
 * a context's positions into byte offsets of their rows through the block table, and the prefetch
 * of those rows.
 *
 * Owns the cache's layout ([num_blocks, block_size, num_kv_heads, head_dim], contiguous, the same for
 * K and V) and the check of every block id read from a block table; knows nothing of the attention
 * computed on the rows or of the metadata's other checks.
 */

#ifndef PAGEDSERVE_PAGED_ROWS_H
#define PAGEDSERVE_PAGED_ROWS_H

#include <stdint.h>

#define CACHE_LINE 64
#define PREFETCH_LOCALITY_L2 1
#define PREFETCH_LOCALITY_L1 3

/* Where a work item's next context position lives (entry block_index of its block table, offset in
 * that block), and what makes a position's row offset: the cache's sizes, the item's kv head and
 * the bytes of a row. */
struct cursor {
    const int32_t *block_table;
    int64_t num_blocks, block_size, num_kv_heads, kv_head, row_bytes;
    int64_t block_index, offset;
};

/* Byte offsets in either cache of the rows of the next n positions, advancing the cursor (no
 * division per position: block_size need not be a power of two). Returns 0, or 1 at a block id
 * outside the cache. */
static inline int next_rows(struct cursor *at, int n, int64_t *rows)
{
    for (int j = 0; j < n; j++, at->offset++) {
        if (at->offset == at->block_size) {
            at->block_index++;
            at->offset = 0;
        }
        const int64_t block = at->block_table[at->block_index];
        if (block < 0 || block >= at->num_blocks)
            return 1;
        rows[j] = ((block * at->block_size + at->offset) * at->num_kv_heads + at->kv_head) * at->row_bytes;
    }
    return 0;
}

/* Ask for the next tile's rows while this one is computed: a context's blocks are scattered, which
 * the hardware prefetchers cannot guess, and past the L2 cache the copy or use of a tile otherwise
 * waits on each row in turn (measured, prefill on one thread: a 2,048-token prompt ran 1.9x faster
 * with it). Into the L2 cache only (locality 1): prefetches into L1 fill its few miss buffers and
 * stall the loads of the tile being computed (measured, decode: a third slower on contexts read
 * from memory). One row of each cache: */
static inline __attribute__((always_inline)) void prefetch_row(const void *k_cache, const void *v_cache, int64_t row,
                                                               int64_t row_bytes)
{
    for (int64_t line = 0; line < row_bytes; line += CACHE_LINE) {
        __builtin_prefetch((const char *)k_cache + row + line, 0, PREFETCH_LOCALITY_L2);
        __builtin_prefetch((const char *)v_cache + row + line, 0, PREFETCH_LOCALITY_L2);
    }
}

static inline void prefetch_rows(const void *k_cache, const void *v_cache, const int64_t *rows, int n,
                                 int64_t row_bytes)
{
    for (int j = 0; j < n; j++)
        prefetch_row(k_cache, v_cache, rows[j], row_bytes);
}

#endif
