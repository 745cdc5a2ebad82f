/*
 * The arithmetic of an int8-weight linear layer at the linear kernel's AVX2 register tile (6 rows by 16
 * columns), two ways, on data that stays in the first-level cache, so that only the instructions count:
 *
 * - dequantize: each int8 weight widened to float32 (two conversions per 8 weights) and one FMA per
 *   weight and row against float32 activations: what cpu_linear.c does;
 * - W8A8: activations quantized to uint8, four consecutive inputs of a column in each 32-bit lane of the
 *   weights, vpmaddubsw (uint8 x int8, adjacent pairs summed to int16) then vpmaddwd by ones (pairs of
 *   those summed to int32): four products per lane in two instructions, plus the add.
 *
 * Each returns the multiply-adds it did; tools/bench/kernels/bench_int8_dot.py times them. Left out of
 * both: what is paid once per row or column rather than per weight (quantizing a row of activations,
 * the int32 sums' conversion and scales, the correction for uint8's offset), which a full kernel would
 * add. Built for AVX2 and up; below it both return -1.
 */

#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROWS 6
#define COLUMNS 16

/* w [k][COLUMNS] int8, x [ROWS][k] float32 -> out [ROWS][COLUMNS] (the last pass's sums). */
int64_t probe_dequantize(const int8_t *w, const float *x, float *out, int64_t k, int64_t passes)
{
#if defined(__AVX2__)
    for (int64_t pass = 0; pass < passes; pass++) {
        __m256 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++) {
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i * COLUMNS))));
            __m256 w1 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i * COLUMNS + 8))));
            for (int r = 0; r < ROWS; r++) {
                __m256 xr = _mm256_broadcast_ss(x + r * k + i);
                acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(out + r * COLUMNS, acc[r][0]);
            _mm256_storeu_ps(out + r * COLUMNS + 8, acc[r][1]);
        }
    }
    return passes * k * ROWS * COLUMNS;
#else
    (void)w, (void)x, (void)out, (void)k, (void)passes;
    return -1;
#endif
}

/* w [k / 4][COLUMNS][4] int8 (four consecutive inputs of a column in a 32-bit lane), x [ROWS][k] uint8 ->
 * out [ROWS][COLUMNS] int32 (the last pass's sums). k a multiple of 4. */
int64_t probe_w8a8(const int8_t *w, const uint8_t *x, int32_t *out, int64_t k, int64_t passes)
{
#if defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t pass = 0; pass < passes; pass++) {
        __m256i acc[ROWS][2];
        for (int r = 0; r < ROWS; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int64_t i = 0; i < k; i += 4) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + i * COLUMNS));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + i * COLUMNS + 32));
            for (int r = 0; r < ROWS; r++) {
                int32_t four;
                __builtin_memcpy(&four, x + r * k + i, sizeof four);
                __m256i xr = _mm256_set1_epi32(four);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xr, w0), ones));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xr, w1), ones));
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_si256((__m256i *)(out + r * COLUMNS), acc[r][0]);
            _mm256_storeu_si256((__m256i *)(out + r * COLUMNS + 8), acc[r][1]);
        }
    }
    return passes * k * ROWS * COLUMNS;
#else
    (void)w, (void)x, (void)out, (void)k, (void)passes;
    return -1;
#endif
}
