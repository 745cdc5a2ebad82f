/*
 * Paged prefill attention on the CPU: each sequence's query_len new tokens (the last query_len of its
 * seq_len positions) attend causally over its context, reading K and V in place from the paged KV
 * cache (no gather copy, no padded tensor, no repeated kv heads).
 *
 * Owns the arithmetic of a step's prefill attention. Knows nothing of Python, torch, models or
 * scheduling: cpu_prefill.py checks shapes, dtypes and contiguity, then hands over raw pointers,
 * strides and sizes (layouts as in metadata.py); every index read from the metadata is checked
 * against those sizes here before it is used.
 *
 * How it works: one work item per (sequence, kv head, tile of query positions), heaviest first,
 * spread over OpenMP threads. An item holds ITEM_ROWS query rows: its positions times the kv head's
 * group of query heads, so each key and value row is read once for the whole group. The rows lie
 * across the lanes of a vector (one row per lane, ROW_VECTORS vectors), queries and outputs
 * transposed to [head_dim][lane]: a score tile is then LANES vectors (one per key) of LANES rows, built by
 * broadcasting each key element against a query column, and the softmax's max, sum and rescale are
 * lane-wise, with no reductions across lanes. The item walks its context a tile of KEY_TILE keys at
 * a time up to the causal limit of its last row, wherever the blocks lie, keeping per row a running
 * max, a denominator and a float32 output: online softmax in base 2. A tile's keys and values are
 * copied (bfloat16: widened) into contiguous buffers once and used by every row vector. With
 * avx512_bf16, bfloat16 scores come from _mm512_dpbf16_ps on pairs of head dims (exact products,
 * float32 sums); P·V stays float32 FMA on widened values, as rounding the probabilities to
 * bfloat16 would cost more than one bfloat16 step of the result.
 */

#include <stdlib.h>

#include "paged_rows.h"
#include "vector_math.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

#define KEY_TILE LANES /* keys per tile: one score vector per key */
#define ROW_VECTORS 3
#define ITEM_ROWS (ROW_VECTORS * LANES) /* query rows (positions x group heads) of a work item */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define VALUE_COLUMNS 8 /* output columns accumulated at once in P·V: 8 + 16 probabilities in registers */

/* Limits of a work item's on-stack buffers, read by cpu_prefill.py, which sends anything else to the
 * torch path. */
const int32_t pagedserve_prefill_max_group = MAX_GROUP;
const int32_t pagedserve_prefill_max_head_dim = MAX_HEAD_DIM;
const int32_t pagedserve_prefill_head_dim_multiple = LANES;

enum { CACHE_FLOAT32 = 0, CACHE_BFLOAT16 = 1 };
enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_BAD_DTYPE = 2, STATUS_BAD_SEQ_LEN = 3, STATUS_BAD_BLOCK = 4,
       STATUS_BAD_SEQ_ID = 5, STATUS_BAD_ROWS = 6, STATUS_NO_MEMORY = 7 };

/* Everything a work item reads, gathered from the exported function's arguments. */
struct prefill_step {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
    int64_t num_blocks, block_size, num_kv_heads, head_dim, group;
    float log2_scale; /* softmax scale * log2(e): scores come out in base-2 units */
};

/* One work item: num_positions consecutive query positions from first_position (q rows from
 * first_row) of one kv head of the sequence at seq_ids[prefill]. */
struct work_item {
    const int32_t *block_table;
    int64_t prefill, kv_head, first_row, first_position, num_positions;
};

/* A work item's running state. Row m of the item (position m / group, query head m % group) is lane
 * m % LANES of row vector m / LANES; rows past the item's last repeat its last row. */
struct item_state {
    union { /* the item's queries, transposed: [head_dim][LANES] floats, or [head_dim / 2][LANES] bf16 pairs */
        float floats[ROW_VECTORS][MAX_HEAD_DIM * LANES];
        uint32_t bf16_pairs[ROW_VECTORS][MAX_HEAD_DIM / 2 * LANES];
    } q_t;
    float out_t[ROW_VECTORS][MAX_HEAD_DIM * LANES]; /* unnormalised outputs, [head_dim][LANES] */
    vfloat running_max[ROW_VECTORS], denominator[ROW_VECTORS];
    vint position[ROW_VECTORS];
    int num_vectors; /* row vectors holding at least one of the item's rows */
    int64_t min_position[ROW_VECTORS], max_position[ROW_VECTORS];
    union { /* the tile's keys, [KEY_TILE][head_dim]: widened floats, or bfloat16 as stored, read in pairs */
        float floats[KEY_TILE * MAX_HEAD_DIM];
        uint32_t bf16_pairs[KEY_TILE * MAX_HEAD_DIM / 2];
    } keys;
    float values[KEY_TILE * MAX_HEAD_DIM]; /* the tile's values, [KEY_TILE][head_dim] floats */
};

static inline float bf16_to_float(uint16_t bits)
{
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

#if BF16_DOT
/* acc + the sum over pairs of a[2i] * b[2i] + a[2i+1] * b[2i+1], lane-wise, where each 32-bit lane of
 * a_pairs holds two bfloat16 and b_pair is one such pair for every lane. */
static inline vfloat dot_bf16_pairs(vfloat acc, vuint a_pairs, uint32_t b_pair)
{
    return (vfloat)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a_pairs, (__m512bh)_mm512_set1_epi32((int)b_pair));
}
#endif

/* The item's queries, transposed into lanes, and an empty running state. */
ALWAYS_INLINE void start_item(const struct prefill_step *s, const struct work_item *w, struct item_state *it,
                              int is_bf16, int head_dim)
{
    const int64_t num_rows = w->num_positions * s->group;
    for (int64_t m = 0; m < ITEM_ROWS; m++) {
        const int64_t row = m < num_rows ? m : num_rows - 1, lane = m % LANES, vector = m / LANES;
        const int64_t position_index = row / s->group, head = w->kv_head * s->group + row % s->group;
        const int64_t offset = (w->first_row + position_index) * s->q_token_stride + head * s->q_head_stride;
        if (is_bf16 && BF16_DOT) {
            const uint16_t *query = (const uint16_t *)s->q + offset;
            for (int d = 0; d < head_dim / 2; d++)
                it->q_t.bf16_pairs[vector][d * LANES + lane] = query[2 * d] | (uint32_t)query[2 * d + 1] << 16;
        } else if (is_bf16) {
            const uint16_t *query = (const uint16_t *)s->q + offset;
            for (int d = 0; d < head_dim; d++)
                it->q_t.floats[vector][d * LANES + lane] = bf16_to_float(query[d]);
        } else {
            const float *query = (const float *)s->q + offset;
            for (int d = 0; d < head_dim; d++)
                it->q_t.floats[vector][d * LANES + lane] = query[d];
        }
        it->position[vector][lane] = (int32_t)(w->first_position + position_index);
    }
    it->num_vectors = (int)((num_rows + LANES - 1) / LANES);
    for (int v = 0; v < ROW_VECTORS; v++) {
        it->running_max[v] = broadcast(-INFINITY);
        it->denominator[v] = broadcast(0.0f);
        it->min_position[v] = it->position[v][0];
        it->max_position[v] = it->position[v][LANES - 1];
        memset(it->out_t[v], 0, sizeof(float) * head_dim * LANES);
    }
}

/* Copy a tile's n key and value rows (byte offsets `rows`) into the item's tile buffers; rows past n
 * are zeros. */
ALWAYS_INLINE void load_tile(const struct prefill_step *s, struct item_state *it, const int64_t *rows, int n,
                             int is_bf16, int head_dim)
{
    for (int j = 0; j < n; j++) {
        float *key = it->keys.floats + j * head_dim, *value = it->values + j * head_dim;
        if (is_bf16) {
            const uint16_t *key_row = (const uint16_t *)((const char *)s->k_cache + rows[j]);
            const uint16_t *value_row = (const uint16_t *)((const char *)s->v_cache + rows[j]);
            for (int d = 0; d < head_dim; d += LANES) {
                if (BF16_DOT)
                    memcpy(it->keys.bf16_pairs + (j * head_dim + d) / 2, key_row + d, LANES * sizeof(uint16_t));
                else
                    store_floats(key + d, load_bf16(key_row + d));
                store_floats(value + d, load_bf16(value_row + d));
            }
        } else {
            memcpy(key, (const char *)s->k_cache + rows[j], head_dim * sizeof(float));
            memcpy(value, (const char *)s->v_cache + rows[j], head_dim * sizeof(float));
        }
    }
    if (n < KEY_TILE) {
        const size_t key_bytes = (is_bf16 && BF16_DOT ? sizeof(uint16_t) : sizeof(float)) * head_dim;
        memset((char *)it->keys.floats + n * key_bytes, 0, (KEY_TILE - n) * key_bytes);
        memset(it->values + n * head_dim, 0, (KEY_TILE - n) * head_dim * sizeof(float));
    }
}

/* scores[j]: row vector v's scores against key j of the tile, in base-2 units. */
ALWAYS_INLINE void tile_scores(const struct item_state *it, int v, int is_bf16, int head_dim, float log2_scale,
                               vfloat scores[KEY_TILE])
{
#pragma GCC unroll 16
    for (int j = 0; j < KEY_TILE; j++)
        scores[j] = broadcast(0.0f);
#if BF16_DOT
    if (is_bf16) {
        const uint32_t *key_pairs = it->keys.bf16_pairs;
        for (int d = 0; d < head_dim / 2; d++) {
            vuint queries;
            memcpy(&queries, it->q_t.bf16_pairs[v] + d * LANES, sizeof queries);
#pragma GCC unroll 16
            for (int j = 0; j < KEY_TILE; j++)
                scores[j] = dot_bf16_pairs(scores[j], queries, key_pairs[j * head_dim / 2 + d]);
        }
    } else
#endif
    {
        for (int d = 0; d < head_dim; d++) {
            vfloat queries = load_floats(it->q_t.floats[v] + d * LANES);
#pragma GCC unroll 16
            for (int j = 0; j < KEY_TILE; j++)
                scores[j] += queries * it->keys.floats[j * head_dim + d];
        }
    }
#pragma GCC unroll 16
    for (int j = 0; j < KEY_TILE; j++)
        scores[j] *= log2_scale;
}

/* Fold a tile's scores (keys from tile_start) into row vector v's running max and denominator; the
 * scores become the probabilities the values are weighted with. Returns the factor the outputs so far
 * are rescaled by. Keys past a row's position (causal) weigh 2^-126 of the running max: nothing. */
ALWAYS_INLINE vfloat online_softmax(struct item_state *it, int v, int64_t tile_start, vfloat scores[KEY_TILE])
{
    if (tile_start + KEY_TILE - 1 > it->min_position[v]) { /* the tile reaches past some row's position */
#pragma GCC unroll 16
        for (int j = 0; j < KEY_TILE; j++)
            scores[j] = select_lanes(it->position[v] >= (int32_t)(tile_start + j), scores[j], broadcast(-INFINITY));
    }
    vfloat tile_max = scores[0];
#pragma GCC unroll 16
    for (int j = 1; j < KEY_TILE; j++)
        tile_max = max_lanes(tile_max, scores[j]);
    const vfloat new_max = max_lanes(it->running_max[v], tile_max);
    const vfloat rescale = exp2_nonpositive(it->running_max[v] - new_max);
    vfloat sum = broadcast(0.0f);
#pragma GCC unroll 16
    for (int j = 0; j < KEY_TILE; j++) {
        scores[j] = exp2_nonpositive(scores[j] - new_max);
        sum += scores[j];
    }
    it->denominator[v] = it->denominator[v] * rescale + sum;
    it->running_max[v] = new_max;
    return rescale;
}

/* Row vector v's outputs: rescaled, plus the tile's values weighted by probs. */
ALWAYS_INLINE void accumulate_values(struct item_state *it, int v, int head_dim, vfloat rescale,
                                     const vfloat probs[KEY_TILE])
{
    for (int d0 = 0; d0 < head_dim; d0 += VALUE_COLUMNS) {
        vfloat columns[VALUE_COLUMNS];
#pragma GCC unroll 8
        for (int c = 0; c < VALUE_COLUMNS; c++)
            columns[c] = load_floats(it->out_t[v] + (d0 + c) * LANES) * rescale;
#pragma GCC unroll 16
        for (int j = 0; j < KEY_TILE; j++)
#pragma GCC unroll 8
            for (int c = 0; c < VALUE_COLUMNS; c++)
                columns[c] += probs[j] * it->values[j * head_dim + d0 + c];
#pragma GCC unroll 8
        for (int c = 0; c < VALUE_COLUMNS; c++)
            store_floats(it->out_t[v] + (d0 + c) * LANES, columns[c]);
    }
}

/* Each real row's output: its accumulated values over its denominator, in the dtype of out. */
ALWAYS_INLINE void finish_item(const struct prefill_step *s, const struct work_item *w, const struct item_state *it,
                               int is_bf16, int head_dim)
{
    for (int64_t m = 0; m < w->num_positions * s->group; m++) {
        const int64_t lane = m % LANES, vector = m / LANES;
        const int64_t offset = (w->first_row + m / s->group) * s->out_token_stride +
                               (w->kv_head * s->group + m % s->group) * s->out_head_stride;
        const float inverse = 1.0f / it->denominator[vector][lane];
        float row[MAX_HEAD_DIM];
        for (int d = 0; d < head_dim; d++)
            row[d] = it->out_t[vector][d * LANES + lane] * inverse;
        for (int d = 0; d < head_dim; d += LANES) {
            if (is_bf16) {
                vbf16 rounded = to_bf16(load_floats(row + d));
                memcpy((uint16_t *)s->out + offset + d, &rounded, sizeof rounded);
            } else {
                memcpy((float *)s->out + offset + d, row + d, LANES * sizeof(float));
            }
        }
    }
}

static inline int tile_keys(int64_t context, int64_t tile_start)
{
    return context - tile_start < KEY_TILE ? (int)(context - tile_start) : KEY_TILE;
}

/* One work item, start to finish. is_bf16 and head_dim are constants where the caller specialises. */
ALWAYS_INLINE int attend_item(const struct prefill_step *s, const struct work_item *w, int is_bf16, int head_dim)
{
    struct item_state it;
    int64_t rows[2][KEY_TILE]; /* byte offsets of this tile's rows and the next one's */
    const int64_t context = w->first_position + w->num_positions; /* keys the item's last row sees */
    const int64_t row_bytes = head_dim * (is_bf16 ? sizeof(uint16_t) : sizeof(float));
    struct cursor at = {w->block_table, s->num_blocks, s->block_size, s->num_kv_heads, w->kv_head, row_bytes, 0, 0};
    start_item(s, w, &it, is_bf16, head_dim);
    if (next_rows(&at, tile_keys(context, 0), rows[0]))
        return STATUS_BAD_BLOCK;
    for (int64_t tile_start = 0, tile = 0; tile_start < context; tile_start += KEY_TILE, tile++) {
        if (tile_start + KEY_TILE < context) {
            const int upcoming = tile_keys(context, tile_start + KEY_TILE);
            if (next_rows(&at, upcoming, rows[(tile + 1) % 2]))
                return STATUS_BAD_BLOCK;
            prefetch_rows(s->k_cache, s->v_cache, rows[(tile + 1) % 2], upcoming, row_bytes);
        }
        load_tile(s, &it, rows[tile % 2], tile_keys(context, tile_start), is_bf16, head_dim);
        for (int v = 0; v < it.num_vectors; v++) {
            if (tile_start > it.max_position[v])
                continue;
            vfloat scores[KEY_TILE];
            tile_scores(&it, v, is_bf16, head_dim, s->log2_scale, scores);
            const vfloat rescale = online_softmax(&it, v, tile_start, scores);
            accumulate_values(&it, v, head_dim, rescale, scores);
        }
    }
    finish_item(s, w, &it, is_bf16, head_dim);
    return STATUS_OK;
}

/* A copy of the loops per dtype, and per common head size, with head_dim a constant the compiler
 * unrolls. */
static int attend_item_specialised(const struct prefill_step *s, const struct work_item *w, int is_bf16)
{
    const int head_dim = (int)s->head_dim;
    if (is_bf16)
        return head_dim == 64 ? attend_item(s, w, 1, 64) : head_dim == 128 ? attend_item(s, w, 1, 128)
                                                                            : attend_item(s, w, 1, head_dim);
    return head_dim == 64 ? attend_item(s, w, 0, 64) : head_dim == 128 ? attend_item(s, w, 0, 128)
                                                                        : attend_item(s, w, 0, head_dim);
}

/* Heaviest first (scores computed: positions x the context of the last), so that the threads finish
 * together; ties in a fixed order. */
static int heavier_first(const void *a, const void *b)
{
    const struct work_item *x = a, *y = b;
    const int64_t work_x = x->num_positions * (x->first_position + x->num_positions);
    const int64_t work_y = y->num_positions * (y->first_position + y->num_positions);
    if (work_x != work_y)
        return work_x > work_y ? -1 : 1;
    if (x->prefill != y->prefill)
        return x->prefill < y->prefill ? -1 : 1;
    if (x->kv_head != y->kv_head)
        return x->kv_head < y->kv_head ? -1 : 1;
    return (x->first_position > y->first_position) - (x->first_position < y->first_position);
}

/* Check each prefill's metadata and cut it into work items (*items, malloc'd; *num_items of them). */
static int plan_items(const struct prefill_step *s, const int32_t *block_tables, int64_t block_table_stride,
                      int64_t block_table_width, const int32_t *seq_lens, const int32_t *query_start_loc,
                      int64_t num_tokens, int64_t num_seqs, const int32_t *seq_ids, int64_t num_prefills,
                      struct work_item **items, int64_t *num_items, int64_t *failed_prefill)
{
    const int64_t positions_per_item = ITEM_ROWS / s->group;
    int64_t count = 0;
    for (int64_t i = 0; i < num_prefills; i++) {
        *failed_prefill = i;
        const int64_t seq = seq_ids[i];
        if (seq < 0 || seq >= num_seqs)
            return STATUS_BAD_SEQ_ID;
        const int64_t start = query_start_loc[seq], end = query_start_loc[seq + 1], seq_len = seq_lens[seq];
        if (start < 0 || end > num_tokens || end <= start)
            return STATUS_BAD_ROWS;
        if (seq_len < end - start || seq_len > block_table_width * s->block_size)
            return STATUS_BAD_SEQ_LEN;
        count += s->num_kv_heads * ((end - start + positions_per_item - 1) / positions_per_item);
    }
    *failed_prefill = -1;
    *items = malloc((count ? count : 1) * sizeof **items);
    if (*items == NULL)
        return STATUS_NO_MEMORY;
    *num_items = 0;
    for (int64_t i = 0; i < num_prefills; i++) {
        const int64_t seq = seq_ids[i], start = query_start_loc[seq], query_len = query_start_loc[seq + 1] - start;
        for (int64_t kv_head = 0; kv_head < s->num_kv_heads; kv_head++)
            for (int64_t first = 0; first < query_len; first += positions_per_item)
                (*items)[(*num_items)++] = (struct work_item){
                    .block_table = block_tables + seq * block_table_stride, .prefill = i, .kv_head = kv_head,
                    .first_row = start + first, .first_position = seq_lens[seq] - query_len + first,
                    .num_positions = query_len - first < positions_per_item ? query_len - first : positions_per_item};
    }
    qsort(*items, *num_items, sizeof **items, heavier_first);
    return STATUS_OK;
}

/*
 * Prefill attention of num_prefills sequences: sequence seq = seq_ids[i] (of the metadata's num_seqs)
 * has its new tokens' queries in q rows query_start_loc[seq] .. query_start_loc[seq + 1] (of
 * num_tokens; [num_heads, head_dim], num_heads = num_kv_heads * group), at the last positions of its
 * context, the first seq_lens[seq] positions of the caches ([num_blocks, block_size, num_kv_heads,
 * head_dim], contiguous) through block_tables[seq] (int32, block_table_width entries); the results go
 * to the same rows of out. dtype is CACHE_FLOAT32 or CACHE_BFLOAT16 for q, out and both caches alike;
 * head_dim a multiple of LANES. Returns STATUS_OK, or a problem found, with the i of a sequence it was
 * found in at *failed_prefill (-1 where none; out is then incomplete).
 */
int pagedserve_prefill_attention(int dtype, const void *q, int64_t q_token_stride, int64_t q_head_stride, void *out,
                                 int64_t out_token_stride, int64_t out_head_stride, const void *k_cache,
                                 const void *v_cache, int64_t num_tokens, int64_t num_blocks, int64_t block_size,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t group, const int32_t *block_tables,
                                 int64_t block_table_stride, int64_t block_table_width, const int32_t *seq_lens,
                                 const int32_t *query_start_loc, int64_t num_seqs, const int32_t *seq_ids,
                                 int64_t num_prefills, float scale, int num_threads, int64_t *failed_prefill)
{
    *failed_prefill = -1;
    if (dtype != CACHE_FLOAT32 && dtype != CACHE_BFLOAT16)
        return STATUS_BAD_DTYPE;
    if (group < 1 || group > MAX_GROUP || head_dim < LANES || head_dim > MAX_HEAD_DIM || head_dim % LANES ||
        block_size < 1 || num_kv_heads < 1 || num_tokens < 0 || num_seqs < 0 || num_prefills < 0 ||
        block_table_width < 0)
        return STATUS_BAD_SIZES;
    const struct prefill_step s = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
        .q_token_stride = q_token_stride, .q_head_stride = q_head_stride,
        .out_token_stride = out_token_stride, .out_head_stride = out_head_stride,
        .num_blocks = num_blocks, .block_size = block_size, .num_kv_heads = num_kv_heads,
        .head_dim = head_dim, .group = group, .log2_scale = scale * 1.4426950408889634f,
    };
    struct work_item *items = NULL;
    int64_t num_items = 0;
    int status = plan_items(&s, block_tables, block_table_stride, block_table_width, seq_lens, query_start_loc,
                            num_tokens, num_seqs, seq_ids, num_prefills, &items, &num_items, failed_prefill);
    if (status != STATUS_OK)
        return status;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_items; i++) {
        int item_status = attend_item_specialised(&s, &items[i], dtype == CACHE_BFLOAT16);
        if (item_status != STATUS_OK) {
#pragma omp critical
            {
                status = item_status;
                *failed_prefill = items[i].prefill;
            }
        }
    }
    free(items);
    return status;
}
