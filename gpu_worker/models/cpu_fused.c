/*
 * The per-row layer ops of a Llama block on the CPU, each in one pass over its rows: residual add +
 * RMSNorm, RMSNorm, SiLU(gate) * up, rotary embedding of q and k in place, and the store of each row's
 * new k and v at its KV cache slot.
 *
 * Owns the arithmetic of those ops. Knows nothing of Python, torch or models: cpu_fused.py checks
 * shapes, dtypes and strides, then hands over raw pointers, strides (in elements) and sizes; the
 * sizes and strides are checked again here before any row is touched.
 *
 * How it works: one row at a time, in plain loops the compiler vectorises (-O3 -march=native), on
 * as many OpenMP threads as the caller asks for (one for a decode batch: waking a second thread
 * costs more than a few rows take). Values are computed in float32; where torch rounds an
 * intermediate to the tensor's dtype, so does the kernel (round_to_dtype), so that bfloat16 results
 * match torch's op for op: RMSNorm rounds the normalised row before the weight multiply, rotary
 * rounds x * cos and rot * sin before adding them, SiLU rounds before multiplying by up. For the
 * same reason rotary is compiled without contraction of a * b + c into one fused multiply-add:
 * torch rounds the float32 products too. exp is a polynomial the compiler vectorises (libm's expf
 * is a call per element without -ffast-math, which a shared library must not use: it would switch
 * the whole process to flush-to-zero).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../attention/vector_math.h"
#include "silu_lanes.h"

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_BAD_DTYPE = 2, STATUS_BAD_SLOT = 3 };

ALWAYS_INLINE float bits_to_float(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

ALWAYS_INLINE uint32_t float_to_bits(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does; NaN becomes torch's quiet NaN. */
ALWAYS_INLINE uint16_t float_to_bf16(float f)
{
    uint32_t bits = float_to_bits(f);
    uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    return f != f ? 0x7fc0 : (uint16_t)rounded;
}

ALWAYS_INLINE float load(const void *row, int64_t i, int is_bf16)
{
    return is_bf16 ? bits_to_float((uint32_t)((const uint16_t *)row)[i] << 16) : ((const float *)row)[i];
}

ALWAYS_INLINE void store(void *row, int64_t i, float value, int is_bf16)
{
    if (is_bf16)
        ((uint16_t *)row)[i] = float_to_bf16(value);
    else
        ((float *)row)[i] = value;
}

/* The value torch would hold after storing `value` in the dtype: float32 is already there. The
 * bfloat16 rounding is float_to_bf16's kept in 32-bit lanes (no narrowing and widening), with a NaN
 * passed through as it is (float_to_bf16 makes it torch's NaN when it is stored). */
ALWAYS_INLINE float round_to_dtype(float value, int is_bf16)
{
    uint32_t bits = float_to_bits(value);
    float rounded = bits_to_float((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u);
    return is_bf16 && value == value ? rounded : value;
}

ALWAYS_INLINE size_t element_size(int is_bf16)
{
    return is_bf16 ? sizeof(uint16_t) : sizeof(float);
}

/* e^x as silu_lanes.h's exp_poly_lanes computes it, one value at a time: the bfloat16 rows' SiLU, whose
 * loop the compiler vectorises. */
ALWAYS_INLINE float exp_poly(float x)
{
    int is_overflow = x > EXP_OVERFLOW;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * EXP_LOG2E + EXP_ROUND_MAGIC) - EXP_ROUND_MAGIC;
    float p = EXP_TAYLOR_7((x - n * EXP_LN2_HI) - n * EXP_LN2_LO);
    return is_overflow ? INFINITY : p * bits_to_float((uint32_t)((int32_t)n + 127) << 23);
}

/* normalised = round(x * rsqrt(mean(x^2) + eps)); out = round(normalised * weight), as torch does. */
ALWAYS_INLINE void normalise_row(const void *x, const void *weight, void *out, int64_t hidden, float eps,
                                 int is_bf16)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
        float v = load(x, i, is_bf16);
        sum += v * v;
    }
    float inverse_rms = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store(out, i, round_to_dtype(load(x, i, is_bf16) * inverse_rms, is_bf16) * load(weight, i, is_bf16), is_bf16);
}

/* residual = round(x + residual), then x = RMSNorm(residual) * weight. */
ALWAYS_INLINE void add_rms_norm_row(void *x, void *residual, const void *weight, int64_t hidden, float eps,
                                    int is_bf16)
{
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store(residual, i, load(x, i, is_bf16) + load(residual, i, is_bf16), is_bf16);
    normalise_row(residual, weight, x, hidden, eps, is_bf16);
}

/* silu_and_mul_row for float32 in explicit vectors: below AVX-512 the compiler leaves that loop scalar (its
 * exp_poly, by lanes of 8, is not vectorised), at a quarter of torch's speed; written out it runs on any
 * vector width. */
ALWAYS_INLINE void silu_and_mul_row_float32(const float *gate, float *out, int64_t size)
{
    const float *up = gate + size;
    int64_t i = 0;
    for (; i + LANES <= size; i += LANES)
        store_floats(out + i, silu_times_lanes(load_floats(gate + i), load_floats(up + i)));
    if (i < size) { /* the last few in a vector too, so that every value is computed as the linear kernel's do */
        float last_gate[LANES] = {0}, last_up[LANES] = {0}, last_out[LANES];
        memcpy(last_gate, gate + i, (size_t)(size - i) * sizeof(float));
        memcpy(last_up, up + i, (size_t)(size - i) * sizeof(float));
        store_floats(last_out, silu_times_lanes(load_floats(last_gate), load_floats(last_up)));
        memcpy(out + i, last_out, (size_t)(size - i) * sizeof(float));
    }
}

/* out = round(round(silu(gate)) * up); gate is the row's first half, up its second. */
ALWAYS_INLINE void silu_and_mul_row(const void *gate_up, void *out, int64_t size, int is_bf16)
{
    const char *up = (const char *)gate_up + size * element_size(is_bf16);
#pragma omp simd
    for (int64_t i = 0; i < size; i++) {
        float gate = load(gate_up, i, is_bf16);
        float silu = round_to_dtype(gate / (1.0f + exp_poly(-gate)), is_bf16);
        store(out, i, silu * load(up, i, is_bf16), is_bf16);
    }
}

static int bad_rows(int dtype, int64_t num_rows, int64_t width, int num_threads)
{
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16)
        return STATUS_BAD_DTYPE;
    return num_rows < 0 || width < 1 || num_threads < 1 ? STATUS_BAD_SIZES : STATUS_OK;
}

/* Row `row` of a matrix with a row stride in elements. */
ALWAYS_INLINE char *row_at(const void *base, int64_t row, int64_t stride, int is_bf16)
{
    return (char *)base + row * stride * (int64_t)element_size(is_bf16);
}

int pagedserve_rms_norm(int dtype, const void *x, int64_t x_stride, const void *weight, void *out,
                        int64_t out_stride, int64_t num_rows, int64_t hidden, float eps, int num_threads)
{
    int status = bad_rows(dtype, num_rows, hidden, num_threads);
    if (status || x_stride < hidden || out_stride < hidden)
        return status ? status : STATUS_BAD_SIZES;
    int is_bf16 = dtype == DTYPE_BFLOAT16;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t row = 0; row < num_rows; row++) {
        if (is_bf16)
            normalise_row(row_at(x, row, x_stride, 1), weight, row_at(out, row, out_stride, 1), hidden, eps, 1);
        else
            normalise_row(row_at(x, row, x_stride, 0), weight, row_at(out, row, out_stride, 0), hidden, eps, 0);
    }
    return STATUS_OK;
}

int pagedserve_add_rms_norm(int dtype, void *x, int64_t x_stride, void *residual, int64_t residual_stride,
                            const void *weight, int64_t num_rows, int64_t hidden, float eps, int num_threads)
{
    int status = bad_rows(dtype, num_rows, hidden, num_threads);
    if (status || x_stride < hidden || residual_stride < hidden)
        return status ? status : STATUS_BAD_SIZES;
    int is_bf16 = dtype == DTYPE_BFLOAT16;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t row = 0; row < num_rows; row++) {
        if (is_bf16)
            add_rms_norm_row(row_at(x, row, x_stride, 1), row_at(residual, row, residual_stride, 1), weight, hidden,
                             eps, 1);
        else
            add_rms_norm_row(row_at(x, row, x_stride, 0), row_at(residual, row, residual_stride, 0), weight, hidden,
                             eps, 0);
    }
    return STATUS_OK;
}

int pagedserve_silu_and_mul(int dtype, const void *gate_up, int64_t gate_up_stride, void *out, int64_t out_stride,
                            int64_t num_rows, int64_t size, int num_threads)
{
    int status = bad_rows(dtype, num_rows, size, num_threads);
    if (status || gate_up_stride < 2 * size || out_stride < size)
        return status ? status : STATUS_BAD_SIZES;
    int is_bf16 = dtype == DTYPE_BFLOAT16;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t row = 0; row < num_rows; row++) {
        if (is_bf16)
            silu_and_mul_row(row_at(gate_up, row, gate_up_stride, 1), row_at(out, row, out_stride, 1), size, 1);
        else
            silu_and_mul_row_float32((const float *)row_at(gate_up, row, gate_up_stride, 0),
                                     (float *)row_at(out, row, out_stride, 0), size);
    }
    return STATUS_OK;
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* One head turned in place by the half-split pairing: x * cos + cat(-second, first) * sin, each
 * product rounded to the dtype before the add. */
ALWAYS_INLINE void rotate_head(void *head, const void *cos, const void *sin, int64_t half, int is_bf16)
{
    char *second = (char *)head + half * element_size(is_bf16);
    const char *cos_second = (const char *)cos + half * element_size(is_bf16);
    const char *sin_second = (const char *)sin + half * element_size(is_bf16);
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        float a = load(head, i, is_bf16), b = load(second, i, is_bf16);
        float a_cos = round_to_dtype(a * load(cos, i, is_bf16), is_bf16);
        float b_sin = round_to_dtype(b * load(sin, i, is_bf16), is_bf16);
        float b_cos = round_to_dtype(b * load(cos_second, i, is_bf16), is_bf16);
        float a_sin = round_to_dtype(a * load(sin_second, i, is_bf16), is_bf16);
        store(head, i, a_cos - b_sin, is_bf16);
        store(second, i, b_cos + a_sin, is_bf16);
    }
}

/* qk: num_rows rows of num_heads heads of head_dim values (row stride qk_stride, heads adjacent);
 * cos, sin: num_rows rows of head_dim values (row stride cos_sin_stride). */
int pagedserve_apply_rotary(int dtype, void *qk, int64_t qk_stride, int64_t num_heads, const void *cos,
                            const void *sin, int64_t cos_sin_stride, int64_t num_rows, int64_t head_dim,
                            int num_threads)
{
    int status = bad_rows(dtype, num_rows, head_dim, num_threads);
    if (status || head_dim % 2 || num_heads < 1 || qk_stride < num_heads * head_dim || cos_sin_stride < head_dim)
        return status ? status : STATUS_BAD_SIZES;
    int is_bf16 = dtype == DTYPE_BFLOAT16;
    int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t row = 0; row < num_rows; row++) {
        for (int64_t head = 0; head < num_heads; head++) {
            int64_t offset = head * head_dim; /* in elements: heads are adjacent */
            if (is_bf16)
                rotate_head((uint16_t *)row_at(qk, row, qk_stride, 1) + offset, row_at(cos, row, cos_sin_stride, 1),
                            row_at(sin, row, cos_sin_stride, 1), half, 1);
            else
                rotate_head((float *)row_at(qk, row, qk_stride, 0) + offset, row_at(cos, row, cos_sin_stride, 0),
                            row_at(sin, row, cos_sin_stride, 0), half, 0);
        }
    }
    return STATUS_OK;
}

#pragma GCC pop_options

/* Each of num_rows rows' new k and v (row_size values each, at row strides k_stride and v_stride) stored at
 * its cache slot: k_cache and v_cache hold num_slots slots of row_size values, slots[row] the row's. Every
 * slot is checked before any is written. */
int pagedserve_write_kv(int dtype, const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache,
                        void *v_cache, const int64_t *slots, int64_t num_rows, int64_t row_size, int64_t num_slots)
{
    int status = bad_rows(dtype, num_rows, row_size, 1);
    if (status || k_stride < row_size || v_stride < row_size)
        return status ? status : STATUS_BAD_SIZES;
    for (int64_t row = 0; row < num_rows; row++)
        if (slots[row] < 0 || slots[row] >= num_slots)
            return STATUS_BAD_SLOT;
    int is_bf16 = dtype == DTYPE_BFLOAT16;
    size_t row_bytes = (size_t)row_size * element_size(is_bf16);
    for (int64_t row = 0; row < num_rows; row++) {
        memcpy(row_at(k_cache, slots[row], row_size, is_bf16), row_at(k, row, k_stride, is_bf16), row_bytes);
        memcpy(row_at(v_cache, slots[row], row_size, is_bf16), row_at(v, row, v_stride, is_bf16), row_bytes);
    }
    return STATUS_OK;
}
