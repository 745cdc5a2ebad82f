/*
 * y = x @ W.T + b in float32 for the few rows of a decode step, streaming W once from a layout packed
 * at load: column tiles of TILE_COLUMNS, each [in_features][TILE_COLUMNS] contiguous. W is float32, or
 * quantized: int8 with one scale per column, or int8 or int4 with one scale per column and group of in_features
 * (int4 with a zero point per group too).
 *
 * Owns the arithmetic of that product. Knows nothing of Python, torch or models: cpu_linear.py packs
 * the weight and checks shapes and strides, then hands over raw pointers, strides (in elements) and
 * sizes; they are checked again here before anything is read.
 *
 * How it works: a register tile of TILE_ROWS rows by TILE_VECTORS vectors of columns accumulates the
 * whole reduction over in_features, each step one load per weight vector and one broadcast per row.
 * The rows run panel by panel over one column tile before the next tile, so the tile is read from
 * memory once and from cache by every later panel; while they run, the next tile is prefetched,
 * spread evenly over the panels, so that reading the weights overlaps the arithmetic instead of
 * alternating with it (1.3-1.6x at 16 rows, where without it the kernel ran no faster than oneDNN).
 * Prefill-sized batches go ROW_BLOCK rows at a time, whose activations stay in the second-level
 * cache. A quantized tile is widened to float32 into a buffer of the thread's (in the first-level
 * cache for in_features up to a few hundred) before its panels run, so the register tile is the same
 * for every format and its cost is shared by all the tile's rows; what is prefetched and read from
 * memory is the quantized bytes, 1/4 (int8) or about 1/8 (int4) of float32's. With no more rows than
 * one register tile (a decode step of a few sequences) nothing would share that buffer, and the tile is
 * widened in registers instead, as it is read.
 * A gated MLP's gate and up projection can be packed in pairs, a vector of gate columns beside the same
 * vector of up columns in each tile (pagedserve_linear_pairs), so that SiLU(gate) * up is taken as the tile is
 * stored, by the thread that computed both, instead of in a pass that reads half its inputs from another core.
 * Column tiles are split between OpenMP threads in contiguous ranges. Vectors are GCC vector
 * extensions as wide as the build's registers: 16 floats with AVX-512, else 8. Products are summed
 * in order of in_features, so results differ from oneDNN's or MKL's in the last bits, as any two
 * BLAS libraries do.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#if defined(__AVX512F__)
#define LANES 16
#define TILE_ROWS 8 /* 16 accumulators of 32 registers; the remainder cases below are written for 8 and 6 */
#else
#define LANES 8
#define TILE_ROWS 6 /* 12 accumulators of AVX2's 16 registers */
#endif
#define TILE_VECTORS 2
#define ROW_BLOCK 96 /* rows whose x stays in the second-level cache while the thread's column tiles pass */
#define TILE_COLUMNS (LANES * TILE_VECTORS)

enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_BAD_FORMAT = 2, STATUS_NO_MEMORY = 3 };
/* How the packed tiles hold W. int8: q[k][c], w = q * scale[c]. int8 grouped: q[k][c] too, w = q *
 * scale[k / group_size][c]. int4: byte j of row k holds column j in its low half and column LANES + j in its
 * high half, as q + 8; w = q * scale[k / group_size][c]. The grouped formats are GGUF's Q8_0 and Q4_0. int4
 * with zero points (AWQ's, asymmetric GPTQ's): the same nibbles n, w = (n - zero[g][c]) * scale[g][c], the
 * zero point held as a float so that the subtraction is exact and w is the dequantized weight to the bit. */
enum { WEIGHTS_FLOAT32 = 0, WEIGHTS_INT8 = 1, WEIGHTS_INT4 = 2, WEIGHTS_INT8_GROUPED = 3, WEIGHTS_INT4_ZERO = 4 };
/* Where a tile's results go. TILES_PLAIN: its TILE_COLUMNS consecutive columns of out. The paired layouts hold a
 * gated MLP's gate and up projection, tile t's first vector gate's columns t * LANES.. and its second up's same
 * columns: TILES_PAIRED stores each where the unpaired product has it (gate in out's first half, up in its
 * second), TILES_SILU stores silu(gate) * up instead, the MLP's activation, so that a gate column and its up
 * column are computed, and multiplied, by the same thread while they are in its registers. */
enum { TILES_PLAIN = 0, TILES_PAIRED = 1, TILES_SILU = 2 };

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t vuint8 __attribute__((vector_size(LANES)));

#include "silu_lanes.h"

#include "linear_argmax.h"

ALWAYS_INLINE vfloat load_floats(const float *p)
{
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Every lane x. Written out lane by lane: `(vfloat){0} + x` would cost an add per broadcast (0 + x is not x
 * for x = -0), in the innermost loop. */
ALWAYS_INLINE vfloat broadcast(float x)
{
#if LANES == 16
    return (vfloat){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vfloat){x, x, x, x, x, x, x, x};
#endif
}

ALWAYS_INLINE void store_floats(float *p, vfloat v)
{
    memcpy(p, &v, sizeof v);
}

/* acc[r] += x[r][k] * w for the tile's `rows` rows. */
ALWAYS_INLINE void accumulate(int rows, vfloat acc[TILE_ROWS][TILE_VECTORS], const float *x, int64_t x_stride,
                              int64_t k, const vfloat w[TILE_VECTORS])
{
    for (int r = 0; r < rows; r++) {
        vfloat xr = broadcast(x[r * x_stride + k]);
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[r][v] += xr * w[v];
    }
}

/* out[r][:columns] = acc[r] * scale (NULL: 1) + bias (NULL: 0), as `pairing` lays a tile out: of a paired tile
 * `columns` of each vector, the second's `second_half` columns after the first's (TILES_PAIRED). */
ALWAYS_INLINE void store_tile(int rows, vfloat acc[TILE_ROWS][TILE_VECTORS], const float *scale, const float *bias,
                              float *out, int64_t out_stride, int64_t columns, int pairing, int64_t second_half)
{
    for (int r = 0; r < rows; r++) {
        float row[TILE_COLUMNS];
        for (int v = 0; v < TILE_VECTORS; v++) {
            vfloat sum = scale ? acc[r][v] * load_floats(scale + v * LANES) : acc[r][v];
            store_floats(row + v * LANES, sum + (bias ? load_floats(bias + v * LANES) : (vfloat){0}));
        }
        float *out_row = out + r * out_stride;
        if (pairing == TILES_SILU)
            store_floats(row, silu_times_lanes(load_floats(row), load_floats(row + LANES)));
        else if (pairing == TILES_PAIRED)
            memcpy(out_row + second_half, row + LANES, (size_t)columns * sizeof(float));
        memcpy(out_row, row, (size_t)columns * sizeof(float));
    }
}

/* One register tile: `rows` (a constant once inlined) rows of x against one packed column tile; the
 * first `columns` columns of the result (all but in the last tile) are stored to out. */
ALWAYS_INLINE void register_tile(int rows, const float *x, int64_t x_stride, const float *tile, const float *bias,
                                 float *out, int64_t out_stride, int64_t in_features, int64_t columns,
                                 const char *prefetch, int64_t prefetch_step, int pairing, int64_t second_half)
{
    vfloat acc[TILE_ROWS][TILE_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[r][v] = (vfloat){0};
    for (int64_t k = 0; k < in_features; k++) {
        vfloat w[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++)
            w[v] = load_floats(tile + k * TILE_COLUMNS + v * LANES);
        if (prefetch)
            __builtin_prefetch(prefetch + k * prefetch_step, 0, 3);
        accumulate(rows, acc, x, x_stride, k, w);
    }
    store_tile(rows, acc, NULL, bias, out, out_stride, columns, pairing, second_half);
}

/* Every row of x against one column tile, TILE_ROWS at a time, the remainder in one smaller tile. */
static void column_tile(const float *x, int64_t x_stride, const float *tile, const float *bias, float *out,
                        int64_t out_stride, int64_t num_rows, int64_t in_features, int64_t columns, const void *next,
                        int64_t next_bytes, int pairing, int64_t second_half)
{
    int64_t panels = (num_rows + TILE_ROWS - 1) / TILE_ROWS;
    int64_t step = (next_bytes + panels * in_features - 1) / (panels * in_features);
    const char *prefetch = (const char *)next; /* may run up to a step past the tile: a prefetch never faults */
    int64_t row = 0;
    for (; row + TILE_ROWS <= num_rows; row += TILE_ROWS, prefetch = prefetch ? prefetch + in_features * step : NULL)
        register_tile(TILE_ROWS, x + row * x_stride, x_stride, tile, bias, out + row * out_stride, out_stride,
                      in_features, columns, prefetch, step, pairing, second_half);
    switch (num_rows - row) {
#define REMAINDER(n)                                                                                                  \
    case n:                                                                                                           \
        register_tile(n, x + row * x_stride, x_stride, tile, bias, out + row * out_stride, out_stride, in_features,  \
                      columns, prefetch, step, pairing, second_half);                                                 \
        break;
        REMAINDER(1)
        REMAINDER(2)
        REMAINDER(3)
        REMAINDER(4)
        REMAINDER(5)
#if TILE_ROWS == 8
        REMAINDER(6)
        REMAINDER(7)
#endif
#undef REMAINDER
    default:
        break;
    }
}

/* The packed layout's column tile width, for the caller's packing. */
int pagedserve_linear_tile_columns(void)
{
    return TILE_COLUMNS;
}

static int64_t packed_tile_bytes(int format, int64_t in_features)
{
    int64_t values = in_features * TILE_COLUMNS;
    if (format == WEIGHTS_FLOAT32)
        return values * (int64_t)sizeof(float);
    return format == WEIGHTS_INT4 || format == WEIGHTS_INT4_ZERO ? values / 2 : values;
}

/* LANES bytes at p, each zero-extended into its 32-bit lane. One instruction where the build has AVX2 or
 * AVX-512; GCC's vector conversion of bytes (below) comes out as one scalar move per byte there. */
ALWAYS_INLINE vint widen_bytes(const uint8_t *p)
{
#if defined(__AVX512F__)
    return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vuint8 bytes;
    memcpy(&bytes, p, sizeof bytes);
    return __builtin_convertvector(bytes, vint);
#endif
}

/* LANES int8 at p, each sign-extended into its 32-bit lane. */
ALWAYS_INLINE vint widen_signed_bytes(const int8_t *p)
{
#if defined(__AVX512F__)
    return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return (widen_bytes((const uint8_t *)p) ^ 0x80) - 128;
#endif
}

/* Vector v of row k of an int8 tile, as float32 (unscaled). */
ALWAYS_INLINE vfloat int8_vector(const int8_t *tile, int64_t k, int v)
{
    return __builtin_convertvector(widen_signed_bytes(tile + k * TILE_COLUMNS + v * LANES), vfloat);
}

/* Row k of an int4 tile ([in_features][LANES] bytes of two int4 each) as float32, scaled by its group's
 * scales. The bytes are widened before they are split: x86 has no shift of bytes. */
ALWAYS_INLINE void int4_row(const uint8_t *tile, int64_t k, vfloat low_scale, vfloat high_scale, vfloat w[TILE_VECTORS])
{
    vint wide = widen_bytes(tile + k * LANES);
    w[0] = __builtin_convertvector((wide & 15) - 8, vfloat) * low_scale;
    w[1] = __builtin_convertvector((wide >> 4) - 8, vfloat) * high_scale;
}

/* Row k of a grouped tile (int4 with or without zero points, or int8 in groups) as float32, scaled by its
 * group's scales (less its zero points first). `format` is a constant wherever this is inlined, so each format's loop holds
 * its own instructions only. */
ALWAYS_INLINE void grouped_row(int format, const uint8_t *tile, int64_t k, const vfloat scale[TILE_VECTORS],
                               const vfloat zero[TILE_VECTORS], vfloat w[TILE_VECTORS])
{
    if (format == WEIGHTS_INT4) {
        int4_row(tile, k, scale[0], scale[1], w);
    } else if (format == WEIGHTS_INT4_ZERO) {
        vint wide = widen_bytes(tile + k * LANES);
        w[0] = (__builtin_convertvector(wide & 15, vfloat) - zero[0]) * scale[0];
        w[1] = (__builtin_convertvector(wide >> 4, vfloat) - zero[1]) * scale[1];
    } else {
        for (int v = 0; v < TILE_VECTORS; v++)
            w[v] = int8_vector((const int8_t *)tile, k, v) * scale[v];
    }
}

/* Floats a group takes in a grouped tile's scales: its scales, and with zero points those after them. */
ALWAYS_INLINE int64_t group_floats(int format)
{
    return format == WEIGHTS_INT4_ZERO ? 2 * TILE_COLUMNS : TILE_COLUMNS;
}

/* One group's scales (and zero points) of a grouped tile ([groups][group_floats]). */
ALWAYS_INLINE void group_scales(int format, const float *scales, int64_t group, vfloat scale[TILE_VECTORS],
                                vfloat zero[TILE_VECTORS])
{
    const float *first = scales + group * group_floats(format);
    for (int v = 0; v < TILE_VECTORS; v++) {
        scale[v] = load_floats(first + v * LANES);
        zero[v] = format == WEIGHTS_INT4_ZERO ? load_floats(first + TILE_COLUMNS + v * LANES) : (vfloat){0};
    }
}

/* tile [in_features][TILE_COLUMNS] int8, scales [TILE_COLUMNS] -> out [in_features][TILE_COLUMNS] float32. */
static void widen_int8(const int8_t *tile, const float *scales, float *out, int64_t in_features)
{
    vfloat scale[TILE_VECTORS];
    for (int v = 0; v < TILE_VECTORS; v++)
        scale[v] = load_floats(scales + v * LANES);
    for (int64_t k = 0; k < in_features; k++)
        for (int v = 0; v < TILE_VECTORS; v++)
            store_floats(out + k * TILE_COLUMNS + v * LANES, int8_vector(tile, k, v) * scale[v]);
}

/* A grouped tile, scales [in_features / group_size][TILE_COLUMNS] -> out [in_features][TILE_COLUMNS] float32. */
ALWAYS_INLINE void widen_grouped_as(int format, const uint8_t *tile, const float *scales, int64_t group_size,
                                    float *out, int64_t in_features)
{
    for (int64_t group = 0; group * group_size < in_features; group++) {
        vfloat scale[TILE_VECTORS], zero[TILE_VECTORS];
        group_scales(format, scales, group, scale, zero);
        for (int64_t k = group * group_size; k < (group + 1) * group_size; k++) {
            vfloat w[TILE_VECTORS];
            grouped_row(format, tile, k, scale, zero, w);
            for (int v = 0; v < TILE_VECTORS; v++)
                store_floats(out + k * TILE_COLUMNS + v * LANES, w[v]);
        }
    }
}

static void widen_grouped(int format, const uint8_t *tile, const float *scales, int64_t group_size, float *out,
                          int64_t in_features)
{
    if (format == WEIGHTS_INT4)
        widen_grouped_as(WEIGHTS_INT4, tile, scales, group_size, out, in_features);
    else if (format == WEIGHTS_INT4_ZERO)
        widen_grouped_as(WEIGHTS_INT4_ZERO, tile, scales, group_size, out, in_features);
    else
        widen_grouped_as(WEIGHTS_INT8_GROUPED, tile, scales, group_size, out, in_features);
}

/* A quantized column tile against at most TILE_ROWS rows, widened in registers as it is read: with a
 * single panel of rows nothing would share a widened buffer, and writing and reading it back costs
 * more than the arithmetic. int8's column scale is applied once, to the sums; a grouped format's per group,
 * to the widened weights. scales: this tile's, [TILE_COLUMNS] (int8) or [groups][TILE_COLUMNS] (grouped). */
ALWAYS_INLINE void quantized_register_tile(int rows, int format, const float *x, int64_t x_stride,
                                           const uint8_t *tile, const float *scales, int64_t group_size,
                                           const float *bias, float *out, int64_t out_stride, int64_t in_features,
                                           int64_t columns, const char *prefetch, int64_t prefetch_step)
{
    vfloat acc[TILE_ROWS][TILE_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < TILE_VECTORS; v++)
            acc[r][v] = (vfloat){0};
    if (format == WEIGHTS_INT8) {
        for (int64_t k = 0; k < in_features; k++) {
            vfloat w[TILE_VECTORS];
            for (int v = 0; v < TILE_VECTORS; v++)
                w[v] = int8_vector((const int8_t *)tile, k, v);
            if (prefetch)
                __builtin_prefetch(prefetch + k * prefetch_step, 0, 3);
            accumulate(rows, acc, x, x_stride, k, w);
        }
        store_tile(rows, acc, scales, bias, out, out_stride, columns, TILES_PLAIN, 0);
        return;
    }
    for (int64_t group = 0; group * group_size < in_features; group++) {
        vfloat scale[TILE_VECTORS], zero[TILE_VECTORS];
        group_scales(format, scales, group, scale, zero);
        for (int64_t k = group * group_size; k < (group + 1) * group_size; k++) {
            vfloat w[TILE_VECTORS];
            grouped_row(format, tile, k, scale, zero, w);
            if (prefetch)
                __builtin_prefetch(prefetch + k * prefetch_step, 0, 3);
            accumulate(rows, acc, x, x_stride, k, w);
        }
    }
    store_tile(rows, acc, NULL, bias, out, out_stride, columns, TILES_PLAIN, 0);
}

/* All num_rows (at most TILE_ROWS) rows of x against one quantized column tile, widened in registers. */
static void quantized_column_tile(int format, const float *x, int64_t x_stride, const uint8_t *tile,
                                  const float *scales, int64_t group_size, const float *bias, float *out,
                                  int64_t out_stride, int64_t num_rows, int64_t in_features, int64_t columns,
                                  const void *next, int64_t next_bytes)
{
    int64_t step = (next_bytes + in_features - 1) / in_features;
    const char *prefetch = (const char *)next;
    switch (num_rows) {
#define ROWS_AS(n, f) \
    quantized_register_tile(n, f, x, x_stride, tile, scales, group_size, bias, out, out_stride, in_features, columns, \
                            prefetch, step)
#define ROWS(n)                                    \
    case n:                                        \
        if (format == WEIGHTS_INT8)                \
            ROWS_AS(n, WEIGHTS_INT8);              \
        else if (format == WEIGHTS_INT4)           \
            ROWS_AS(n, WEIGHTS_INT4);              \
        else if (format == WEIGHTS_INT4_ZERO)      \
            ROWS_AS(n, WEIGHTS_INT4_ZERO);         \
        else                                       \
            ROWS_AS(n, WEIGHTS_INT8_GROUPED);      \
        break;
        ROWS(1)
        ROWS(2)
        ROWS(3)
        ROWS(4)
        ROWS(5)
        ROWS(6)
#if TILE_ROWS == 8
        ROWS(7)
        ROWS(8)
#endif
#undef ROWS
#undef ROWS_AS
    default:
        break;
    }
}

/* Row r of the tile whose first column is `first` (`columns` of them written at row), as it was stored, into its
 * bests; the columns past out_features as -inf. */
static void keep_tile_bests(const float *out, int64_t out_stride, int64_t num_rows, int64_t first, int64_t columns,
                            row_bests *bests)
{
    vint tokens[TILE_VECTORS];
    tile_tokens(first, tokens);
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = out + r * out_stride;
        float padded[TILE_COLUMNS];
        if (columns < TILE_COLUMNS) {
            for (int c = 0; c < TILE_COLUMNS; c++)
                padded[c] = c < columns ? row[c] : -INFINITY;
            row = padded;
        }
        vfloat values[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; v++)
            values[v] = load_floats(row + v * LANES);
        keep_row_bests(&bests[r], values, tokens);
    }
}

/* pagedserve_linear, and with `tokens` ([num_rows] or NULL) each row's argmax of out as written; tiles laid out
 * as `pairing` says, where out_features counts the columns of each half (TILES_PAIRED: out holds twice as many). */
static int linear(const float *x, int64_t x_stride, int format, const void *packed, const float *scales,
                  int64_t group_size, const float *bias, float *out, int64_t out_stride, int64_t num_rows,
                  int64_t in_features, int64_t out_features, int64_t *tokens, int pairing, int num_threads)
{
    int64_t out_width = pairing == TILES_PAIRED ? 2 * out_features : out_features;
    if (num_rows < 0 || in_features <= 0 || out_features <= 0 || x_stride < in_features
        || out_stride < out_width || num_threads < 1)
        return STATUS_BAD_SIZES;
    if (format < WEIGHTS_FLOAT32 || format > WEIGHTS_INT4_ZERO)
        return STATUS_BAD_FORMAT;
    if (format != WEIGHTS_FLOAT32 && scales == NULL)
        return STATUS_BAD_FORMAT;
    if (pairing != TILES_PLAIN && (format != WEIGHTS_FLOAT32 || tokens != NULL || TILE_VECTORS != 2))
        return STATUS_BAD_FORMAT;
    int grouped = format == WEIGHTS_INT4 || format == WEIGHTS_INT8_GROUPED || format == WEIGHTS_INT4_ZERO;
    if (grouped && (TILE_VECTORS != 2 || group_size <= 0 || in_features % group_size))
        return STATUS_BAD_SIZES;
    if (num_rows == 0)
        return STATUS_OK;
    int64_t tile_width = pairing == TILES_PLAIN ? TILE_COLUMNS : LANES; /* out's columns a tile fills (a half's) */
    int64_t num_tiles = (out_features + tile_width - 1) / tile_width;
    int64_t tile_bytes = packed_tile_bytes(format, in_features);
    int threads = num_threads < num_tiles ? num_threads : (int)num_tiles;
    int status = STATUS_OK;
    int in_registers = format != WEIGHTS_FLOAT32 && num_rows <= TILE_ROWS; /* quantized_register_tile */
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
        float *widened = NULL;
        if (format != WEIGHTS_FLOAT32 && !in_registers) {
            widened = aligned_alloc(64, (size_t)(in_features * TILE_COLUMNS) * sizeof(float));
            if (widened == NULL) {
#pragma omp atomic write
                status = STATUS_NO_MEMORY;
                end = begin;
            }
        }
        row_bests *bests = NULL;
        if (tokens != NULL && (bests = new_row_bests(num_rows)) == NULL) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
            end = begin;
        }
        for (int64_t block = 0; block < num_rows; block += ROW_BLOCK) {
            int64_t block_rows = num_rows - block < ROW_BLOCK ? num_rows - block : ROW_BLOCK;
            for (int64_t t = begin; t < end; t++) {
                int64_t first = t * tile_width;
                int64_t columns = out_features - first < tile_width ? out_features - first : tile_width;
                const char *tile = (const char *)packed + t * tile_bytes;
                const float *floats = (const float *)tile;
                const float *tile_scales = format == WEIGHTS_INT8 ? scales + first
                                           : grouped ? scales + t * (in_features / group_size) * group_floats(format)
                                                     : NULL;
                if (in_registers) {
                    quantized_column_tile(format, x + block * x_stride, x_stride, (const uint8_t *)tile, tile_scales,
                                          group_size, bias ? bias + t * TILE_COLUMNS : NULL,
                                          out + block * out_stride + first,
                                          out_stride, block_rows, in_features, columns,
                                          t + 1 < end ? tile + tile_bytes : NULL, tile_bytes);
                } else {
                    if (format == WEIGHTS_INT8) {
                        widen_int8((const int8_t *)tile, tile_scales, widened, in_features);
                        floats = widened;
                    } else if (grouped) {
                        widen_grouped(format, (const uint8_t *)tile, tile_scales, group_size, widened, in_features);
                        floats = widened;
                    }
                    column_tile(x + block * x_stride, x_stride, floats, bias ? bias + t * TILE_COLUMNS : NULL,
                                out + block * out_stride + first, out_stride, block_rows, in_features, columns,
                                t + 1 < end ? tile + tile_bytes : NULL, tile_bytes, pairing, out_features);
                }
                if (bests != NULL)
                    keep_tile_bests(out + block * out_stride + first, out_stride, block_rows, first, columns,
                                    bests + block);
            }
        }
        if (bests != NULL)
            settle_row_bests(bests, num_rows, &settled, thread);
        free(bests);
        free(widened);
    }
    if (tokens != NULL && status == STATUS_OK)
        settle_threads(&settled, settled_team, num_rows, tokens);
    free_settled_rows(&settled);
    return status;
}

/* x [num_rows][in_features] (rows x_stride apart) @ W.T (+ bias [padded out_features] or NULL) ->
 * out [num_rows][out_features] (rows out_stride apart). packed holds ceil(out_features / TILE_COLUMNS)
 * tiles of W in `format`, zero past out_features. scales: NULL for float32; int8: [tiles * TILE_COLUMNS];
 * int4 and int8 grouped: [tiles][in_features / group_size][TILE_COLUMNS]; int4 with zero points:
 * [tiles][in_features / group_size][2][TILE_COLUMNS], each group's scales then its zero points (as n's). */
int pagedserve_linear(const float *x, int64_t x_stride, int format, const void *packed, const float *scales,
                      int64_t group_size, const float *bias, float *out, int64_t out_stride, int64_t num_rows,
                      int64_t in_features, int64_t out_features, int num_threads)
{
    return linear(x, x_stride, format, packed, scales, group_size, bias, out, out_stride, num_rows, in_features,
                  out_features, NULL, TILES_PLAIN, num_threads);
}

/* A gated MLP's gate and up projection in float32, from tiles packed in pairs (TILES_PAIRED's layout; bias, if
 * any, [tiles * TILE_COLUMNS] in the same order), each of `half` columns: with silu 0 out [num_rows][2 * half] as
 * pagedserve_linear would write the unpaired product, with silu 1 out [num_rows][half] = silu(gate) * up. */
int pagedserve_linear_pairs(const float *x, int64_t x_stride, const void *packed, const float *bias, float *out,
                            int64_t out_stride, int64_t num_rows, int64_t in_features, int64_t half, int silu,
                            int num_threads)
{
    return linear(x, x_stride, WEIGHTS_FLOAT32, packed, NULL, 0, bias, out, out_stride, num_rows, in_features, half,
                  NULL, silu ? TILES_SILU : TILES_PAIRED, num_threads);
}

/* pagedserve_linear, and tokens [num_rows] each row's argmax of out (torch's: the lowest column on ties, NaN
 * above everything), taken as the tiles are written: the LM head's greedy choice. out_features at most
 * INT32_MAX. */
int pagedserve_linear_argmax(const float *x, int64_t x_stride, int format, const void *packed, const float *scales,
                             int64_t group_size, const float *bias, float *out, int64_t out_stride, int64_t num_rows,
                             int64_t in_features, int64_t out_features, int64_t *tokens, int num_threads)
{
    if ((tokens == NULL && num_rows > 0) || out_features > INT32_MAX)
        return STATUS_BAD_SIZES;
    return linear(x, x_stride, format, packed, scales, group_size, bias, out, out_stride, num_rows, in_features,
                  out_features, tokens, TILES_PLAIN, num_threads);
}
