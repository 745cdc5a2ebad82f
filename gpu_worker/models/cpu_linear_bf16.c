/*
 * y = x @ W.T + b with x, W and y in bfloat16 and the sums in float32, by AVX-512 BF16's pair products, from a
 * layout packed at load: column tiles of TILE_COLUMNS, each holding, for every pair of in_features (k, k + 1),
 * the tile's columns' two weights side by side: [in_features / 2][TILE_COLUMNS][2].
 *
 * Owns the arithmetic of that product. Knows nothing of Python, torch or models: cpu_linear_bf16.py packs the
 * weight and checks shapes and strides, then hands over raw pointers, strides (in elements) and sizes; they are
 * checked again here before anything is read. Builds without AVX-512 BF16 compile to a stub that reports it
 * unsupported (pagedserve_linear_bf16_supported), so every tier builds every source.
 *
 * How it works: one `vdpbf16ps` multiplies a vector of 16 columns' weight pairs by one row's x pair, broadcast,
 * and adds both products to the 16 float32 sums: twice the products of a float32 FMA per instruction, from half
 * the bytes. A register tile of TILE_ROWS rows by TILE_VECTORS vectors of columns accumulates the whole reduction
 * over in_features. The rows run panel by panel over one column tile before the next, so a tile is read from
 * memory once and from cache by the later panels, while the next tile is prefetched, spread over the panels, as
 * in cpu_linear.c. Prefill-sized batches go ROW_BLOCK rows at a time, whose x stays in the second-level cache.
 * Column tiles are split between OpenMP threads in contiguous ranges. The sums are rounded to bfloat16 (to
 * nearest even) once, at the end, with the bias added in float32; as the products are summed in their own
 * order, results differ from oneDNN's in the last bit of some outputs, as any two libraries' do.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define LANES 16
#define TILE_VECTORS 2
#define TILE_COLUMNS (LANES * TILE_VECTORS)
#define TILE_ROWS 8 /* 16 accumulators of 32 registers */
#define ROW_BLOCK 96

enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_NO_MEMORY = 3, STATUS_UNSUPPORTED = 4 };

/* The packed layout's column tile width, for the caller's packing. */
int pagedserve_linear_bf16_tile_columns(void)
{
    return TILE_COLUMNS;
}

#if defined(__AVX512BF16__)

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

#include "linear_argmax.h"

int pagedserve_linear_bf16_supported(void)
{
    return 1;
}

/* out[r][:columns] = bfloat16(acc[r] + bias), bias NULL: 0. */
ALWAYS_INLINE void store_tile(int rows, __m512 acc[TILE_ROWS][TILE_VECTORS], const float *bias, uint16_t *out,
                              int64_t out_stride, int64_t columns)
{
    for (int r = 0; r < rows; r++) {
        uint16_t row[TILE_COLUMNS];
        for (int v = 0; v < TILE_VECTORS; v++) {
            __m512 sum = bias ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + v * LANES)) : acc[r][v];
            _mm256_storeu_si256((__m256i *)(row + v * LANES), (__m256i)_mm512_cvtneps_pbh(sum));
        }
        memcpy(out + r * out_stride, row, (size_t)columns * sizeof(uint16_t));
    }
}

/* One register tile: `rows` (a constant once inlined) rows of x against one packed column tile. */
ALWAYS_INLINE void register_tile(int rows, const uint16_t *x, int64_t x_stride, const uint16_t *tile,
                                 const float *bias, uint16_t *out, int64_t out_stride, int64_t num_pairs,
                                 int64_t columns, const char *prefetch, int64_t prefetch_step)
{
    __m512 acc[TILE_ROWS][TILE_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < num_pairs; p++) {
        __m512bh w[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++)
            w[v] = (__m512bh)_mm512_loadu_si512(tile + (p * TILE_COLUMNS + v * LANES) * 2);
        if (prefetch)
            __builtin_prefetch(prefetch + p * prefetch_step, 0, 3);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
            __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < TILE_VECTORS; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], xr);
        }
    }
    store_tile(rows, acc, bias, out, out_stride, columns);
}

/* Every row of x against one column tile, TILE_ROWS at a time, the remainder in one smaller tile. */
static void column_tile(const uint16_t *x, int64_t x_stride, const uint16_t *tile, const float *bias, uint16_t *out,
                        int64_t out_stride, int64_t num_rows, int64_t num_pairs, int64_t columns, const void *next,
                        int64_t next_bytes)
{
    int64_t panels = (num_rows + TILE_ROWS - 1) / TILE_ROWS;
    int64_t step = (next_bytes + panels * num_pairs - 1) / (panels * num_pairs);
    const char *prefetch = (const char *)next; /* may run up to a step past the tile: a prefetch never faults */
    int64_t row = 0;
    for (; row + TILE_ROWS <= num_rows; row += TILE_ROWS, prefetch = prefetch ? prefetch + num_pairs * step : NULL)
        register_tile(TILE_ROWS, x + row * x_stride, x_stride, tile, bias, out + row * out_stride, out_stride,
                      num_pairs, columns, prefetch, step);
    switch (num_rows - row) {
#define REMAINDER(n)                                                                                                  \
    case n:                                                                                                           \
        register_tile(n, x + row * x_stride, x_stride, tile, bias, out + row * out_stride, out_stride, num_pairs,    \
                      columns, prefetch, step);                                                                       \
        break;
        REMAINDER(1)
        REMAINDER(2)
        REMAINDER(3)
        REMAINDER(4)
        REMAINDER(5)
        REMAINDER(6)
        REMAINDER(7)
#undef REMAINDER
    default:
        break;
    }
}

/* Row r of the tile whose first column is `first` (`columns` of them written at row), as it was stored and widened
 * to float32, into its bests; the columns past out_features as -inf. */
static void keep_tile_bests(const uint16_t *out, int64_t out_stride, int64_t num_rows, int64_t first, int64_t columns,
                            row_bests *bests)
{
    vint tokens[TILE_VECTORS];
    tile_tokens(first, tokens);
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *row = out + r * out_stride;
        uint16_t padded[TILE_COLUMNS];
        if (columns < TILE_COLUMNS) {
            for (int c = 0; c < TILE_COLUMNS; c++)
                padded[c] = c < columns ? row[c] : 0xff80; /* -inf */
            row = padded;
        }
        vfloat values[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + v * LANES)));
            values[v] = (vfloat)_mm512_slli_epi32(wide, 16); /* bfloat16 is float32's top half */
        }
        keep_row_bests(&bests[r], values, tokens);
    }
}

/* pagedserve_linear_bf16, and with `tokens` ([num_rows] or NULL) each row's argmax of out as written. */
static int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, uint16_t *out,
                       int64_t out_stride, int64_t num_rows, int64_t in_features, int64_t out_features,
                       int64_t *tokens, int num_threads)
{
    if (num_rows < 0 || in_features <= 0 || in_features % 2 || out_features <= 0 || x_stride < in_features
        || out_stride < out_features || num_threads < 1)
        return STATUS_BAD_SIZES;
    if (num_rows == 0)
        return STATUS_OK;
    int64_t num_tiles = (out_features + TILE_COLUMNS - 1) / TILE_COLUMNS;
    int64_t num_pairs = in_features / 2;
    int64_t tile_elements = in_features * TILE_COLUMNS;
    int threads = num_threads < num_tiles ? num_threads : (int)num_tiles;
    int status = STATUS_OK;
    settled_rows settled = {NULL, NULL}; /* with tokens: each thread's rows' argmax */
    int settled_team = 1;
    if (tokens != NULL && !new_settled_rows(&settled, threads, num_rows))
        return STATUS_NO_MEMORY;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        if (thread == 0)
            settled_team = team;
        int64_t begin = num_tiles * thread / team, end = num_tiles * (thread + 1) / team;
        row_bests *bests = NULL;
        if (tokens != NULL && (bests = new_row_bests(num_rows)) == NULL) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
            end = begin;
        }
        for (int64_t block = 0; block < num_rows; block += ROW_BLOCK) {
            int64_t block_rows = num_rows - block < ROW_BLOCK ? num_rows - block : ROW_BLOCK;
            for (int64_t t = begin; t < end; t++) {
                int64_t first = t * TILE_COLUMNS;
                int64_t columns = out_features - first < TILE_COLUMNS ? out_features - first : TILE_COLUMNS;
                const uint16_t *tile = packed + t * tile_elements;
                column_tile(x + block * x_stride, x_stride, tile, bias ? bias + first : NULL,
                            out + block * out_stride + first, out_stride, block_rows, num_pairs, columns,
                            t + 1 < end ? tile + tile_elements : NULL, tile_elements * (int64_t)sizeof(uint16_t));
                if (bests != NULL)
                    keep_tile_bests(out + block * out_stride + first, out_stride, block_rows, first, columns,
                                    bests + block);
            }
        }
        if (bests != NULL)
            settle_row_bests(bests, num_rows, &settled, thread);
        free(bests);
    }
    if (tokens != NULL && status == STATUS_OK)
        settle_threads(&settled, settled_team, num_rows, tokens);
    free_settled_rows(&settled);
    return status;
}

/* x [num_rows][in_features] bfloat16 (rows x_stride apart) @ W.T (+ bias [padded out_features] float32, or NULL)
 * -> out [num_rows][out_features] bfloat16 (rows out_stride apart). packed holds ceil(out_features / TILE_COLUMNS)
 * tiles of W's pairs, zero past out_features; in_features is even. */
int pagedserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias,
                           uint16_t *out, int64_t out_stride, int64_t num_rows, int64_t in_features,
                           int64_t out_features, int num_threads)
{
    return linear_bf16(x, x_stride, packed, bias, out, out_stride, num_rows, in_features, out_features, NULL,
                       num_threads);
}

/* pagedserve_linear_bf16, and tokens [num_rows] each row's argmax of out (torch's over its float32 values: the
 * lowest column on ties, NaN above everything), taken as the tiles are written: the LM head's greedy choice.
 * out_features at most INT32_MAX. */
int pagedserve_linear_bf16_argmax(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias,
                                  uint16_t *out, int64_t out_stride, int64_t num_rows, int64_t in_features,
                                  int64_t out_features, int64_t *tokens, int num_threads)
{
    if ((tokens == NULL && num_rows > 0) || out_features > INT32_MAX)
        return STATUS_BAD_SIZES;
    return linear_bf16(x, x_stride, packed, bias, out, out_stride, num_rows, in_features, out_features, tokens,
                       num_threads);
}

#else

int pagedserve_linear_bf16_supported(void)
{
    return 0;
}

int pagedserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias,
                           uint16_t *out, int64_t out_stride, int64_t num_rows, int64_t in_features,
                           int64_t out_features, int num_threads)
{
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)out_stride, (void)num_rows;
    (void)in_features, (void)out_features, (void)num_threads;
    return STATUS_UNSUPPORTED;
}

int pagedserve_linear_bf16_argmax(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias,
                                  uint16_t *out, int64_t out_stride, int64_t num_rows, int64_t in_features,
                                  int64_t out_features, int64_t *tokens, int num_threads)
{
    (void)tokens;
    return pagedserve_linear_bf16(x, x_stride, packed, bias, out, out_stride, num_rows, in_features, out_features,
                                  num_threads);
}

#endif
