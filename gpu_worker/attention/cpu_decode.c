/*
 * Paged decode attention on the CPU: each sequence's one new query token attends over its whole
 * context, reading K and V in place from the paged KV cache (no gather copy).
 *
 * Owns the arithmetic of a step's decode attention. Knows nothing of Python, torch, models or
 * scheduling: cpu_decode.py checks shapes, dtypes and contiguity, then hands over raw pointers,
 * strides and sizes (layouts as in metadata.py); every index read from the metadata is checked
 * against those sizes here before it is used.
 *
 * How it works: one work item per sequence and run of its kv heads (all of them where there are
 * sequences enough to keep the threads busy, see item_heads), spread over OpenMP threads (dynamic
 * schedule: contexts differ in length). An item holds the query rows of its kv heads' groups of
 * query heads, pre-multiplied by scale * log2(e), and walks the context a tile of LANES positions
 * (16 with AVX-512, else 8) at a time, wherever their blocks lie, keeping per query head a running
 * max, a denominator and a float32 output: online softmax in base 2. Each key and value row comes
 * from the cache once per item, for all its group's query heads, and a tile reads its positions'
 * rows of all the item's heads in the order they lie in the block. A tile takes each stage (scores,
 * softmax, values) for all the item's query heads at once, so that their chains of dependent
 * instructions overlap. A tile's LANES dot products are left as LANES vectors of partial sums and
 * then added across lanes together, by LANES - 1 shuffle-and-adds into one vector of scores,
 * instead of one horizontal sum each. While a tile is computed, the next tile's rows are
 * prefetched, one position at a time (a burst of all of them at once fills the miss buffers): a
 * sequence's blocks are scattered, which the hardware prefetchers cannot guess.
 * bfloat16 caches take one of two paths. Where the compiler targets AVX-512 BF16, dot products
 * (VDPBF16PS) on the rows as they lie in the cache: decode_bf16_dot.h, which says how. Elsewhere
 * (and on request, to compare) bfloat16 rows are widened to float32 (bits << 16) as they are read
 * (value rows into a small tile), so the arithmetic is the same float32 code for both dtypes. Vectors and their
 * arithmetic (bfloat16 widening and rounding, lane reductions, exp2) are vector_math.h's, shared with
 * cpu_prefill.c: GCC vector extensions, not one instruction set's intrinsics, except on the
 * dot-product path. A tile is one vector's LANES keys.
 */

#include "paged_rows.h"
#include "vector_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define ITEMS_PER_THREAD 4
#define MAX_HEAD_DIM 256
#define MAX_CHUNKS (MAX_HEAD_DIM / LANES)

/* Limits of a work item's on-stack buffers, read by cpu_decode.py, which sends anything else to the
 * torch path. */
const int32_t pagedserve_max_group = MAX_GROUP;
const int32_t pagedserve_max_head_dim = MAX_HEAD_DIM;
const int32_t pagedserve_head_dim_multiple = LANES;

enum { CACHE_FLOAT32 = 0, CACHE_BFLOAT16 = 1 };
enum { BF16_WIDENING = 0, BF16_DOT_PRODUCTS = 1 };
enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_BAD_DTYPE = 2, STATUS_BAD_SEQ_LEN = 3, STATUS_BAD_BLOCK = 4,
       STATUS_BAD_SEQ_ID = 5, STATUS_BAD_ROW = 6, STATUS_BAD_BF16_PATH = 7 };

/* The bfloat16 path this build runs by default, read by cpu_decode.py; widening can always be asked for. */
#if defined(__AVX512BF16__)
const int32_t pagedserve_bf16_path = BF16_DOT_PRODUCTS;
#define PAIR_DIMS 32 /* bfloat16 per 512-bit vector: head_dim positions per dot-product chunk */
#define MAX_PAIR_CHUNKS (MAX_HEAD_DIM / PAIR_DIMS)
#define HALF_CHUNK_MASK 0xffff /* the first 16 bfloat16: where head_dim is an odd multiple of 16, its last chunk */
#else
const int32_t pagedserve_bf16_path = BF16_WIDENING;
#endif

typedef float vfloat_row __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)))); /* in a row */

/* Everything a work item reads, gathered from the exported function's arguments. */
struct decode_step {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
    int64_t num_tokens, num_seqs; /* rows of q and out; sequences of the metadata */
    int64_t num_blocks, block_size, num_kv_heads, head_dim, group;
    int64_t item_heads; /* kv heads per work item (a sequence's last item may have fewer) */
    int64_t items_per_seq;
    const int32_t *block_tables, *seq_lens, *query_start_loc, *seq_ids;
    int64_t block_table_stride, block_table_width;
    float log2_scale; /* softmax scale * log2(e): scores come out in base-2 units */
};

/* One work item's running state: per query head of its kv heads' groups (kv head h's group at
 * h * group), its query (times log2_scale), output so far (unnormalised), running max and denominator. */
struct item_state {
    vfloat q[MAX_GROUP][MAX_CHUNKS];
#if defined(__AVX512BF16__)
    __m512bh q_pairs[MAX_GROUP][MAX_PAIR_CHUNKS]; /* the dot-product path's query, rounded to bfloat16 */
    vfloat denominator_lanes[MAX_GROUP]; /* the dot-product path's denominator, added across lanes at the end */
#endif
    vfloat acc[MAX_GROUP][MAX_CHUNKS]; /* on the dot-product path in unpack order, see value_pairs */
    float running_max[MAX_GROUP], denominator[MAX_GROUP];
};

/* The rounds of transpose_sums: pairwise sums of lanes of a and b, interleaved at a width of 1, 2
 * or 4 lanes. The first two stay inside 128-bit quarters (cheap unpack instructions on x86). */
#if LANES == 16
static inline vfloat unpack_sums_1(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
}

static inline vfloat unpack_sums_2(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}

static inline vfloat unpack_sums_4(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
#else
static inline vfloat unpack_sums_1(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
}

static inline vfloat unpack_sums_2(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}

static inline vfloat unpack_sums_4(vfloat a, vfloat b)
{
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

/* Lane j of the result: the sum of v[j]'s lanes (v is used up). After round 1 each quarter (4
 * lanes) of v[i] holds partial sums of v[2i], v[2i+1], v[2i], v[2i+1]; after round 2, one partial
 * sum each of v[4i..4i+3]; the last rounds add the quarters, leaving v[j]'s total in lane j. */
static inline vfloat transpose_sums(vfloat v[LANES])
{
    for (int i = 0; i < LANES / 2; i++)
        v[i] = unpack_sums_1(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < LANES / 4; i++)
        v[i] = unpack_sums_2(v[2 * i], v[2 * i + 1]);
#if LANES == 16
    for (int i = 0; i < 2; i++)
        v[i] = unpack_sums_4(v[2 * i], v[2 * i + 1]);
#endif
    return unpack_sums_4(v[0], v[1]);
}

/* One row of head_dim values as vfloat chunks. */
ALWAYS_INLINE void load_row(const void *row, int is_bf16, int chunks, vfloat *dst)
{
    for (int c = 0; c < chunks; c++)
        dst[c] = is_bf16 ? load_bf16((const uint16_t *)row + c * LANES) : load_floats((const float *)row + c * LANES);
}

/* A tile's scores from its keys' partial sums (lane sums of products[j] = the score of key j), -inf
 * past its n keys. */
ALWAYS_INLINE vfloat tile_scores(vfloat products[LANES], int n)
{
    return select_lanes(lane_indices() < n, transpose_sums(products), broadcast(-INFINITY));
}

/* Fold a tile's scores into query head g's running max and denominator: the tile's probabilities
 * (relative to the new max), and in *rescale the factor for the output so far. */
ALWAYS_INLINE vfloat fold_scores(struct item_state *it, int g, vfloat scores, float *rescale)
{
    float tile_max = lane_max(scores);
    float new_max = tile_max > it->running_max[g] ? tile_max : it->running_max[g];
    *rescale = exp2_nonpositive(broadcast(it->running_max[g] - new_max))[0];
    vfloat probs = exp2_nonpositive(scores - new_max); /* 2^-126 in the -inf lanes: nothing */
    it->denominator[g] = it->denominator[g] * *rescale + lane_sum(probs);
    it->running_max[g] = new_max;
    return probs;
}

/* A tile of n <= LANES consecutive positions of the item's `heads` kv heads (position j's rows at
 * k_cache + rows[j] and v_cache + rows[j], one head after another, row_bytes each): fold their
 * scores into the running max, denominator and output of every query head of the item. Stage by
 * stage: all scores (each position's key rows read as they lie, all heads together), then the
 * softmax, then the values head by head (bfloat16 value rows widened into value_tile first). Reading
 * the cache in the order it lies is what the hardware prefetchers follow: read head by head instead,
 * at a stride, key rows came from memory a third slower (measured, AVX2, 16 sequences of the 135M
 * shape). The next tile's rows (n_next of them at next) are prefetched a position at a time, spread
 * over the scores: a burst of them fills the miss buffers and stalls. */
ALWAYS_INLINE void attend_tile(const struct decode_step *s, struct item_state *it, int heads, int chunks, int n,
                               const int64_t *rows, const int64_t *next, int n_next, int is_bf16,
                               vfloat value_tile[LANES][MAX_CHUNKS])
{
    const int group = (int)s->group;
    const int64_t row_bytes = chunks * LANES * (is_bf16 ? 2 : 4);
    vfloat products[MAX_GROUP][LANES];
    for (int j = 0; j < n; j++) /* this tile's value rows into L1, in the order they lie, for the values stage */
        for (int64_t line = 0; line < row_bytes * heads; line += CACHE_LINE)
            __builtin_prefetch((const char *)s->v_cache + rows[j] + line, 0, PREFETCH_LOCALITY_L1);
    for (int j = 0; j < LANES; j++) {
        if (j < n_next)
            prefetch_row(s->k_cache, s->v_cache, next[j], row_bytes * heads);
        for (int h = 0; h < heads; h++) {
            vfloat key[MAX_CHUNKS];
            if (j < n)
                load_row((const char *)s->k_cache + rows[j] + h * row_bytes, is_bf16, chunks, key);
            else /* past n: a row of zeros, its score masked */
                for (int c = 0; c < chunks; c++)
                    key[c] = broadcast(0.0f);
            for (int g = h * group; g < (h + 1) * group; g++) {
                vfloat sum = it->q[g][0] * key[0];
                for (int c = 1; c < chunks; c++)
                    sum += it->q[g][c] * key[c];
                products[g][j] = sum;
            }
        }
    }
    vfloat probs[MAX_GROUP];
    float rescale[MAX_GROUP];
    for (int g = 0; g < heads * group; g++)
        probs[g] = fold_scores(it, g, tile_scores(products[g], n), &rescale[g]);
    for (int h = 0; h < heads; h++) {
        const vfloat_row *values[LANES];
        for (int j = 0; j < n; j++) {
            const char *value_row = (const char *)s->v_cache + rows[j] + h * row_bytes;
            if (is_bf16) {
                load_row(value_row, 1, chunks, value_tile[j]);
                value_row = (const char *)value_tile[j];
            }
            values[j] = (const vfloat_row *)value_row;
        }
        for (int g = h * group; g < (h + 1) * group; g++) {
            vfloat out[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++)
                out[c] = it->acc[g][c] * rescale[g];
            for (int j = 0; j < n; j++)
                for (int c = 0; c < chunks; c++)
                    out[c] += probs[g][j] * values[j][c];
            for (int c = 0; c < chunks; c++)
                it->acc[g][c] = out[c];
        }
    }
}

#include "decode_bf16_dot.h" /* the dot-product path, built on the state and helpers above */

static inline int tile_keys(int64_t seq_len, int64_t start)
{
    return seq_len - start < LANES ? (int)(seq_len - start) : LANES;
}

/* The item's query rows (scaled into base-2 units) and an empty running state. */
ALWAYS_INLINE void start_item(const struct decode_step *s, struct item_state *it, int64_t row, int64_t kv_head,
                              int heads, int is_bf16, int dot_products, int chunks)
{
    for (int g = 0; g < heads * s->group; g++) {
        int64_t offset = row * s->q_token_stride + (kv_head * s->group + g) * s->q_head_stride;
        load_row((const char *)s->q + offset * (is_bf16 ? 2 : 4), is_bf16, chunks, it->q[g]);
        for (int c = 0; c < chunks; c++) {
            it->q[g][c] *= s->log2_scale;
            it->acc[g][c] = broadcast(0.0f);
        }
        it->running_max[g] = -INFINITY;
        it->denominator[g] = 0.0f;
#if defined(__AVX512BF16__)
        if (dot_products)
            start_dot_query(it, g, chunks);
#endif
    }
}

/* Each query head's output: its accumulated values over its denominator, in the dtype of out. */
ALWAYS_INLINE void finish_item(const struct decode_step *s, const struct item_state *it, int64_t row,
                               int64_t kv_head, int heads, int is_bf16, int dot_products, int chunks)
{
    for (int g = 0; g < heads * s->group; g++) {
        int64_t offset = row * s->out_token_stride + (kv_head * s->group + g) * s->out_head_stride;
        float inverse = 1.0f / it->denominator[g];
        const vfloat *acc = it->acc[g];
#if defined(__AVX512BF16__)
        vfloat ordered[MAX_CHUNKS];
        if (dot_products) {
            dot_output_in_order(it, g, chunks, ordered);
            acc = ordered;
            inverse = 1.0f / lane_sum(it->denominator_lanes[g]);
        }
#endif
        for (int c = 0; c < chunks; c++) {
            vfloat value = acc[c] * inverse;
            if (is_bf16) {
                vbf16 rounded = to_bf16(value);
                memcpy((uint16_t *)s->out + offset + c * LANES, &rounded, sizeof rounded);
            } else {
                memcpy((float *)s->out + offset + c * LANES, &value, sizeof value);
            }
        }
    }
}

/* Work item `item`: of sequence seq_ids[item / items_per_seq], the item_heads kv heads from
 * (item % items_per_seq) * item_heads on (fewer where the heads run out; a sequence's items one after
 * another). A position's rows of consecutive kv heads lie next to each other in the cache, so an item
 * of several heads reads whole stretches of a block where one of one head reads every
 * num_kv_heads-th row. is_bf16, dot_products (bfloat16 only) and chunks (head_dim / LANES) are
 * constants where the caller specialises. */
ALWAYS_INLINE int attend_item(const struct decode_step *s, int64_t item, int is_bf16, int dot_products, int chunks)
{
    const int64_t kv_head = item % s->items_per_seq * s->item_heads, seq = s->seq_ids[item / s->items_per_seq];
    const int heads = (int)(s->num_kv_heads - kv_head < s->item_heads ? s->num_kv_heads - kv_head : s->item_heads);
    if (seq < 0 || seq >= s->num_seqs)
        return STATUS_BAD_SEQ_ID;
    const int64_t seq_len = s->seq_lens[seq], row = s->query_start_loc[seq];
    const int32_t *block_table = s->block_tables + seq * s->block_table_stride;
    const int64_t row_bytes = chunks * LANES * (is_bf16 ? 2 : 4);
    if (row < 0 || row >= s->num_tokens)
        return STATUS_BAD_ROW;
    if (seq_len < 1 || seq_len > s->block_table_width * s->block_size)
        return STATUS_BAD_SEQ_LEN;

    struct item_state it;
    vfloat value_tile[LANES][MAX_CHUNKS];
#if defined(__AVX512BF16__)
    __m512i value_pair_tile[LANES / 2][MAX_CHUNKS];
#endif
    int64_t rows[2][LANES]; /* byte offsets of this tile's rows and the next one's */
    struct cursor at = {block_table, s->num_blocks, s->block_size, s->num_kv_heads, kv_head, row_bytes, 0, 0};
    start_item(s, &it, row, kv_head, heads, is_bf16, dot_products, chunks);
    if (next_rows(&at, tile_keys(seq_len, 0), rows[0]))
        return STATUS_BAD_BLOCK;
    for (int64_t start = 0, tile = 0; start < seq_len; start += LANES, tile++) {
        int n = tile_keys(seq_len, start), n_next = start + LANES < seq_len ? tile_keys(seq_len, start + LANES) : 0;
        int64_t *next = rows[(tile + 1) % 2];
        if (n_next && next_rows(&at, n_next, next))
            return STATUS_BAD_BLOCK;
#if defined(__AVX512BF16__)
        if (dot_products) { /* it prefetches the next rows itself, spread over its keys */
            attend_dot_tile(s, &it, rows[tile % 2], n, chunks, value_pair_tile, next, n_next);
            continue;
        }
#endif
        attend_tile(s, &it, heads, chunks, n, rows[tile % 2], next, n_next, is_bf16, value_tile);
    }
    finish_item(s, &it, row, kv_head, heads, is_bf16, dot_products, chunks);
    return STATUS_OK;
}

/* A copy of the loops per dtype and bfloat16 path, and per common head size, with head_dim a
 * constant the compiler unrolls fully. */
static int attend_item_specialised(const struct decode_step *s, int64_t item, int is_bf16, int dot_products)
{
    int chunks = (int)(s->head_dim / LANES);
    if (is_bf16 && dot_products)
        return chunks == 4 ? attend_item(s, item, 1, 1, 4) : chunks == 8 ? attend_item(s, item, 1, 1, 8)
                                                           : attend_item(s, item, 1, 1, chunks);
    if (is_bf16)
        return chunks == 4 ? attend_item(s, item, 1, 0, 4) : chunks == 8 ? attend_item(s, item, 1, 0, 8)
                                                           : attend_item(s, item, 1, 0, chunks);
    return chunks == 4 ? attend_item(s, item, 0, 0, 4) : chunks == 8 ? attend_item(s, item, 0, 0, 8)
                                                       : attend_item(s, item, 0, 0, chunks);
}

/* The kv heads of a work item: as many as the state's MAX_GROUP query heads hold, halved while that
 * leaves fewer than ITEMS_PER_THREAD items a thread (contexts differ in length: the dynamic schedule
 * needs several items a thread to even them out). One on the dot-product path, whose tile step attends
 * a single kv head. */
static int64_t item_heads(int64_t num_kv_heads, int64_t group, int64_t num_decodes, int num_threads, int dot_products)
{
    if (dot_products)
        return 1;
    int64_t heads = MAX_GROUP / group < num_kv_heads ? MAX_GROUP / group : num_kv_heads;
    while (heads > 1 && num_decodes * ((num_kv_heads + heads - 1) / heads) < ITEMS_PER_THREAD * num_threads)
        heads = (heads + 1) / 2;
    return heads;
}

/*
 * Decode attention of num_decodes sequences: sequence seq = seq_ids[i] (of the metadata's num_seqs)
 * has its query in q row query_start_loc[seq] (of num_tokens; [num_heads, head_dim], num_heads =
 * num_kv_heads * group), its context the first seq_lens[seq] positions of the caches ([num_blocks,
 * block_size, num_kv_heads, head_dim], contiguous) through block_tables[seq] (int32,
 * block_table_width entries); the result goes to the same row of out. dtype is CACHE_FLOAT32 or
 * CACHE_BFLOAT16 for q, out and both caches alike; head_dim a multiple of LANES. bf16_path is
 * BF16_WIDENING or this build's pagedserve_bf16_path (float32 ignores it). Returns STATUS_OK,
 * or a problem found, with the i of a sequence it was found in at *failed_decode (out is then
 * incomplete).
 */
int pagedserve_decode_attention(int dtype, int bf16_path, const void *q, int64_t q_token_stride,
                                int64_t q_head_stride, void *out, int64_t out_token_stride, int64_t out_head_stride,
                                const void *k_cache, const void *v_cache, int64_t num_tokens, int64_t num_blocks,
                                int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t group,
                                const int32_t *block_tables, int64_t block_table_stride, int64_t block_table_width,
                                const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                                const int32_t *seq_ids, int64_t num_decodes, float scale, int num_threads,
                                int64_t *failed_decode)
{
    if (dtype != CACHE_FLOAT32 && dtype != CACHE_BFLOAT16)
        return STATUS_BAD_DTYPE;
    if (bf16_path != BF16_WIDENING && bf16_path != pagedserve_bf16_path)
        return STATUS_BAD_BF16_PATH;
    if (group < 1 || group > MAX_GROUP || head_dim < LANES || head_dim > MAX_HEAD_DIM || head_dim % LANES ||
        block_size < 1 || num_kv_heads < 1 || num_tokens < 0 || num_seqs < 0 || num_decodes < 0)
        return STATUS_BAD_SIZES;
    const int64_t heads = item_heads(num_kv_heads, group, num_decodes, num_threads,
                                     dtype == CACHE_BFLOAT16 && bf16_path == BF16_DOT_PRODUCTS);
    const struct decode_step s = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out,
        .q_token_stride = q_token_stride, .q_head_stride = q_head_stride,
        .out_token_stride = out_token_stride, .out_head_stride = out_head_stride,
        .num_tokens = num_tokens, .num_seqs = num_seqs,
        .num_blocks = num_blocks, .block_size = block_size, .num_kv_heads = num_kv_heads,
        .head_dim = head_dim, .group = group, .block_tables = block_tables, .seq_lens = seq_lens,
        .query_start_loc = query_start_loc, .seq_ids = seq_ids, .block_table_stride = block_table_stride,
        .block_table_width = block_table_width, .log2_scale = scale * 1.4426950408889634f,
        .item_heads = heads, .items_per_seq = (num_kv_heads + heads - 1) / heads,
    };
    int status = STATUS_OK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < s.items_per_seq * num_decodes; item++) {
        int item_status = attend_item_specialised(&s, item, dtype == CACHE_BFLOAT16, bf16_path == BF16_DOT_PRODUCTS);
        if (item_status != STATUS_OK) {
#pragma omp critical
            {
                status = item_status;
                *failed_decode = item / s.items_per_seq;
            }
        }
    }
    return status;
}
