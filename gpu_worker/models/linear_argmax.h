/*
 * The argmax of each row of a linear kernel's output, taken as its column tiles are written: the LM head's greedy
 * choice without reading the logits again after the product (a decode step's 64 rows of a 4,096-token vocabulary
 * re-read cost 55-80 us of host time, from the other cores' caches).
 *
 * Owns the per-thread running bests and their settling; argmax_lanes.h owns the rules (torch's argmax: the lowest
 * token on ties, NaN above everything). Each thread keeps, per row, a vector of bests per TILE_VECTORS of its
 * tiles' columns, shown its tiles in increasing column order; each thread's bests are then settled to one token
 * per row, and the threads' tokens in thread order, their contiguous column ranges increasing with the thread.
 * The including kernel defines LANES, vfloat, vint, TILE_VECTORS and TILE_COLUMNS, and reads each row of a tile
 * it wrote back as vectors, the columns past out_features as -inf (which never beat a real column's value).
 */

#ifndef PAGEDSERVE_LINEAR_ARGMAX_H
#define PAGEDSERVE_LINEAR_ARGMAX_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../sampling/argmax_lanes.h"

typedef struct {
    vfloat value[TILE_VECTORS];
    vint token[TILE_VECTORS];
} row_bests;

/* num_rows rows of bests, none seen yet (-inf at token 0, as an argmax over nothing but -inf answers); NULL when
 * there is no memory. */
static row_bests *new_row_bests(int64_t num_rows)
{
    row_bests *bests = aligned_alloc(64, (size_t)num_rows * sizeof(row_bests));
    if (bests == NULL)
        return NULL;
    for (int64_t r = 0; r < num_rows; r++)
        for (int v = 0; v < TILE_VECTORS; v++)
            for (int i = 0; i < LANES; i++) {
                bests[r].value[v][i] = -INFINITY;
                bests[r].token[v][i] = 0;
            }
    return bests;
}

/* The tokens of the tile whose first column is `first`, vector by vector. */
static inline __attribute__((always_inline)) void tile_tokens(int64_t first, vint tokens[TILE_VECTORS])
{
#if LANES == 16
    const vint lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vint lanes = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
    for (int v = 0; v < TILE_VECTORS; v++)
        tokens[v] = lanes + (int32_t)(first + v * LANES);
}

/* One row's outputs of a tile (its tokens from tile_tokens), as vectors, taken into its bests. */
static inline __attribute__((always_inline)) void keep_row_bests(row_bests *bests, const vfloat values[TILE_VECTORS],
                                                                 const vint tokens[TILE_VECTORS])
{
    for (int v = 0; v < TILE_VECTORS; v++)
        keep_best(values[v], tokens[v], &bests->value[v], &bests->token[v]);
}

/* Each thread's rows settled to a token and its value: [threads][num_rows], thread 0's columns first. */
typedef struct {
    float *values;
    int64_t *tokens;
} settled_rows;

/* Room for `threads` threads' settled rows; 0 (and nothing held) when there is no memory. */
static int new_settled_rows(settled_rows *settled, int threads, int64_t num_rows)
{
    settled->values = malloc((size_t)(threads * num_rows) * sizeof(float));
    settled->tokens = malloc((size_t)(threads * num_rows) * sizeof(int64_t));
    if (settled->values != NULL && settled->tokens != NULL)
        return 1;
    free(settled->values);
    free(settled->tokens);
    settled->values = NULL;
    settled->tokens = NULL;
    return 0;
}

static void free_settled_rows(settled_rows *settled)
{
    free(settled->values);
    free(settled->tokens);
}

/* A thread's bests, one per row, settled into its part of `settled`. */
static void settle_row_bests(const row_bests *bests, int64_t num_rows, settled_rows *settled, int thread)
{
    for (int64_t r = 0; r < num_rows; r++)
        settled->tokens[thread * num_rows + r] = settle_lanes(bests[r].value, bests[r].token, TILE_VECTORS,
                                                             &settled->values[thread * num_rows + r]);
}

/* The `team` threads' settled rows -> one token per row, into out [num_rows]. */
static void settle_threads(const settled_rows *settled, int team, int64_t num_rows, int64_t *out)
{
    for (int64_t r = 0; r < num_rows; r++) {
        float top = settled->values[r];
        int64_t winner = settled->tokens[r];
        for (int t = 1; t < team; t++)
            if (beats(settled->values[t * num_rows + r], top)) {
                top = settled->values[t * num_rows + r];
                winner = settled->tokens[t * num_rows + r];
            }
        out[r] = winner;
    }
}

#endif
