/*
 * The AVX-512 BF16 dot-product path of cpu_decode.c for bfloat16 caches: its tile step
 * (attend_dot_tile), and how its query starts and its output ends.
 *
 * Part of cpu_decode.c, included by it after the work item's state (struct item_state) and the
 * float32 path's helpers it builds on (tile_scores); not a header of its own. Compiled only where
 * the compiler targets AVX-512 BF16.
 *
 * How it works: VDPBF16PS multiplies pairs of bfloat16 and adds both products to one float32 lane,
 * so a query rounded to bfloat16 (after scaling) meets each key row as it lies in the cache, two
 * head_dim positions per lane; for the values the pairs run along the keys instead: two consecutive
 * keys' value rows are interleaved (16-bit unpack, once per tile for the whole group) and meet the
 * broadcast pair of their probabilities, rounded to bfloat16. An odd tile's lone last key is paired
 * with a row of zeros. The unpack interleaves within 128-bit quarters, so the output accumulates in
 * that permuted order and is put back in order once, at the end. Softmax state and accumulators stay
 * float32. The path takes each stage of a tile for the whole group (attend_dot_tile), its scores a
 * query head at a time so that they stay in registers, and uses AVX-512 intrinsics where they save
 * instructions over vector_math.h's portable code.
 */

#if defined(__AVX512BF16__)
static const uint16_t zero_bf16_row[MAX_HEAD_DIM];

/* Pair chunks of a row of chunks * LANES bfloat16: the last is half a chunk when chunks is odd. */
static inline int pair_chunks(int chunks)
{
    return (chunks + 1) / 2;
}

/* Chunk c of a bfloat16 row: 32 positions, or the last 16 and zeros (the row ends there). */
ALWAYS_INLINE __m512i load_pair_chunk(const uint16_t *row, int c, int chunks)
{
    return 2 * c + 1 < chunks ? _mm512_loadu_si512(row + c * PAIR_DIMS)
                              : _mm512_maskz_loadu_epi16(HALF_CHUNK_MASK, row + c * PAIR_DIMS);
}

/* The tile's value rows two keys at a time, interleaved position by position (keys 2k, 2k + 1 in the
 * low, high half of each 32-bit lane): pairs[k][2c] holds positions 32c + 8i + 0..3 of each 128-bit
 * quarter i, pairs[k][2c + 1] positions 32c + 8i + 4..7 (the unpack instructions stay in quarters).
 * An odd n's lone last key is paired with zeros. */
ALWAYS_INLINE void value_pairs(const struct decode_step *s, const int64_t *rows, int n, int chunks,
                               __m512i pairs[LANES / 2][MAX_CHUNKS])
{
    for (int k = 0; 2 * k < n; k++) {
        const uint16_t *first = (const uint16_t *)((const char *)s->v_cache + rows[2 * k]);
        const uint16_t *second = 2 * k + 1 < n ? (const uint16_t *)((const char *)s->v_cache + rows[2 * k + 1])
                                               : zero_bf16_row;
        for (int c = 0; c < pair_chunks(chunks); c++) {
            __m512i a = load_pair_chunk(first, c, chunks), b = load_pair_chunk(second, c, chunks);
            pairs[k][2 * c] = _mm512_unpacklo_epi16(a, b);
            pairs[k][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
    }
}

/* Shuffle selectors of 4 elements (128-bit blocks of a vector, or floats of a block): the two pairs
 * swapped, and each pair's two swapped. */
#define SWAP_PAIRS 0x4e /* 2, 3, 0, 1 */
#define SWAP_NEIGHBOURS 0xb1 /* 1, 0, 3, 2 */

/* lane_max by VMAXPS: one instruction where the portable compare-and-select takes two. */
static inline float lane_max_avx512(__m512 v)
{
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, SWAP_PAIRS));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, SWAP_NEIGHBOURS));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, SWAP_PAIRS));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, SWAP_NEIGHBOURS));
    return _mm512_cvtss_f32(v);
}

/* exp2_nonpositive by AVX-512's own instructions: VMAXPS clamps, VRNDSCALEPS rounds and VSCALEFPS
 * multiplies by the power of two, one instruction each where the portable code takes two to four. */
static inline __m512 exp2_nonpositive_avx512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp2_fraction(_mm512_sub_ps(x, whole)), whole);
}

/* fold_scores for every query head of the group at once: one exp2 for all their rescale factors (lane g:
 * head g's), and denominators kept per lane, added across at the end. */
ALWAYS_INLINE void fold_group_scores(struct item_state *it, int group, const vfloat scores[MAX_GROUP],
                                     vfloat probs[MAX_GROUP], vfloat *rescale)
{
    vfloat max_drop = broadcast(0.0f);
    for (int g = 0; g < group; g++) {
        float tile_max = lane_max_avx512(scores[g]);
        float new_max = tile_max > it->running_max[g] ? tile_max : it->running_max[g];
        max_drop[g] = it->running_max[g] - new_max;
        it->running_max[g] = new_max;
    }
    *rescale = exp2_nonpositive_avx512(max_drop);
    for (int g = 0; g < group; g++) {
        probs[g] = exp2_nonpositive_avx512(scores[g] - it->running_max[g]); /* 2^-126 in the -inf lanes: nothing */
        it->denominator_lanes[g] = it->denominator_lanes[g] * (*rescale)[g] + probs[g];
    }
}

/* attend_tile with VDPBF16PS on the cache's bfloat16 rows: scores from the query's pairs and each key
 * row in place; the output from each pair of value rows and the pair of their probabilities. One stage
 * at a time for the whole group (scores, softmax, values). The scores go a query head at a time: its
 * LANES dot products are independent of each other, enough to fill the CPU's out-of-order window, and
 * they stay in registers until they are added across lanes. Kept for all heads at once, they went to
 * the stack and back, and the key loop was not unrolled (measured, bench_attention: 1.15-1.28x on a
 * shared prefix the caches hold, 1.03-1.04x on contexts read from memory). A key row is read once per
 * query head, from the first-level cache after the first. The next tile's rows (n_next of them at
 * next) are prefetched one per key, spread over the stage: a burst of them fills the miss buffers and
 * stalls. */
ALWAYS_INLINE void attend_dot_tile(const struct decode_step *s, struct item_state *it, const int64_t *rows, int n,
                                   int chunks, __m512i pairs[LANES / 2][MAX_CHUNKS], const int64_t *next, int n_next)
{
    const int group = (int)s->group;
    value_pairs(s, rows, n, chunks, pairs);
    vfloat scores[MAX_GROUP], probs[MAX_GROUP], rescale;
    for (int g = 0; g < group; g++) { /* one query head at a time: its LANES partial sums stay in registers */
        vfloat products[LANES];
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++) { /* keys past n are rows of zeros */
            const uint16_t *key = j < n ? (const uint16_t *)((const char *)s->k_cache + rows[j]) : zero_bf16_row;
            if (j % group == g && j < n_next) /* the next tile's rows, spread over the whole stage */
                prefetch_row(s->k_cache, s->v_cache, next[j], chunks * LANES * (int64_t)sizeof(uint16_t));
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < pair_chunks(chunks); c++)
                sum = _mm512_dpbf16_ps(sum, it->q_pairs[g][c], (__m512bh)load_pair_chunk(key, c, chunks));
            products[j] = sum;
        }
        scores[g] = tile_scores(products, n);
    }
    fold_group_scores(it, group, scores, probs, &rescale);
    uint32_t prob_pairs[MAX_GROUP][LANES / 2]; /* keys 2k, 2k + 1 in the low, high half, as in the value pairs */
    for (int g = 0; g < group; g++) {
        __m256bh rounded = _mm512_cvtneps_pbh(probs[g]);
        memcpy(prob_pairs[g], &rounded, sizeof rounded);
    }
    const int num_pairs = (n + 1) / 2;
    for (int g = 0; g < group; g++) {
        /* Even and odd pairs in two sets of accumulators where a row has few chunks: twice the independent
         * chains of additions, each half as long. From 8 chunks on (head_dim 128) the chunks are chains
         * enough, and a second set would not fit in the registers (measured: a fifth slower). The pairs go
         * two at a time, so that each set is named, not indexed by k: indexed, the sets lived on the stack. */
        vfloat even[MAX_CHUNKS], odd[MAX_CHUNKS];
        for (int c = 0; c < 2 * pair_chunks(chunks); c++) {
            even[c] = it->acc[g][c] * rescale[g];
            odd[c] = broadcast(0.0f);
        }
        int k = 0;
        if (chunks < 8) {
            for (; k + 1 < num_pairs; k += 2) {
                __m512bh first = (__m512bh)_mm512_set1_epi32((int)prob_pairs[g][k]);
                __m512bh second = (__m512bh)_mm512_set1_epi32((int)prob_pairs[g][k + 1]);
                for (int c = 0; c < 2 * pair_chunks(chunks); c++) {
                    even[c] = _mm512_dpbf16_ps(even[c], (__m512bh)pairs[k][c], first);
                    odd[c] = _mm512_dpbf16_ps(odd[c], (__m512bh)pairs[k + 1][c], second);
                }
            }
        }
        for (; k < num_pairs; k++) {
            __m512bh both = (__m512bh)_mm512_set1_epi32((int)prob_pairs[g][k]);
            for (int c = 0; c < 2 * pair_chunks(chunks); c++)
                even[c] = _mm512_dpbf16_ps(even[c], (__m512bh)pairs[k][c], both);
        }
        for (int c = 0; c < 2 * pair_chunks(chunks); c++)
            it->acc[g][c] = even[c] + odd[c];
    }
}

/* Query head g's query pairs: its scaled float32 row rounded to bfloat16, 32 positions a chunk. */
ALWAYS_INLINE void start_dot_query(struct item_state *it, int g, int chunks)
{
    for (int c = 0; c < pair_chunks(chunks); c++) {
        vfloat high = 2 * c + 1 < chunks ? it->q[g][2 * c + 1] : broadcast(0.0f);
        it->q_pairs[g][c] = _mm512_cvtne2ps_pbh(high, it->q[g][2 * c]);
    }
    for (int c = chunks; c < 2 * pair_chunks(chunks); c++)
        it->acc[g][c] = broadcast(0.0f);
    it->denominator_lanes[g] = broadcast(0.0f);
}

/* Query head g's accumulated output back in head_dim order (see value_pairs for the order it is in). */
ALWAYS_INLINE void dot_output_in_order(const struct item_state *it, int g, int chunks, vfloat ordered[MAX_CHUNKS])
{
    for (int c = 0; c < pair_chunks(chunks); c++) {
        vfloat low = it->acc[g][2 * c], high = it->acc[g][2 * c + 1];
        ordered[2 * c] = __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        if (2 * c + 1 < chunks)
            ordered[2 * c + 1] =
                __builtin_shufflevector(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    }
}
#endif
