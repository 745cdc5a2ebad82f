/*
 * Vector helpers of the CPU attention kernels: 16-float vectors, bfloat16 widening and rounding,
 * lane reductions and a base-2 exponential.
 *
 * Owns arithmetic on vectors only; knows nothing of caches, metadata or attention. Vectors are GCC
 * vector extensions (16 floats, split by the compiler where the CPU's registers are narrower), not
 * one instruction set's intrinsics. exp2 is a polynomial the compiler vectorises (libm's is a call
 * per element without -ffast-math, which a shared library must not use: it would switch the whole
 * process to flush-to-zero).
 */

#ifndef PAGEDSERVE_VECTOR_MATH_H
#define PAGEDSERVE_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define LANES 16 /* floats per vector; the shuffles below are written for 16 */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vbf16 __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline vfloat broadcast(float x)
{
    return (vfloat){0} + x;
}

static inline vfloat select_lanes(vint mask, vfloat if_set, vfloat if_clear)
{
    return (vfloat)(((vint)if_set & mask) | ((vint)if_clear & ~mask));
}

static inline vfloat load_floats(const float *p)
{
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_floats(float *p, vfloat v)
{
    memcpy(p, &v, sizeof v);
}

/* bfloat16 is the top half of a float32: widening is a shift. */
static inline vfloat load_bf16(const uint16_t *p)
{
    vbf16 bits;
    memcpy(&bits, p, sizeof bits);
    return (vfloat)(__builtin_convertvector(bits, vuint) << 16);
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays a quiet NaN. */
static inline vbf16 to_bf16(vfloat v)
{
    vuint bits = (vuint)v;
    vuint rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
    vint is_nan = v != v;
    vuint chosen = ((bits >> 16 | 0x40) & (vuint)is_nan) | (rounded & ~(vuint)is_nan);
    return __builtin_convertvector(chosen, vbf16);
}

static inline vfloat max_lanes(vfloat a, vfloat b)
{
    return select_lanes(a > b, a, b);
}

/* Halves folded onto each other: 8 + 8, 4 + 4, 2 + 2, 1 + 1 lanes. */
static inline float lane_max(vfloat v)
{
    v = max_lanes(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = max_lanes(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = max_lanes(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = max_lanes(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

static inline float lane_sum(vfloat v)
{
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* 2^f for |f| <= 1/2: a degree-7 Taylor polynomial (truncation error < 1e-8, below float32 rounding). */
static inline vfloat exp2_fraction(vfloat f)
{
    vfloat poly = broadcast(1.5252734e-05f);
    poly = poly * f + 1.5403530e-04f;
    poly = poly * f + 1.3333558e-03f;
    poly = poly * f + 9.6181291e-03f;
    poly = poly * f + 5.5504109e-02f;
    poly = poly * f + 2.4022651e-01f;
    poly = poly * f + 6.9314718e-01f;
    poly = poly * f + 1.0f;
    return poly;
}

/* 2^x for x <= 0: 2^round(x) built in the exponent bits times 2^f, f = x - round(x). Below -126 the
 * result is clamped to 2^-126, which next to the running max's 2^0 = 1 adds nothing. */
static inline vfloat exp2_nonpositive(vfloat x)
{
    x = select_lanes(x > -126.0f, x, broadcast(-126.0f));
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vfloat whole = (x + round_magic) - round_magic;
    vint exponent_bits = (__builtin_convertvector(whole, vint) + 127) << 23;
    return exp2_fraction(x - whole) * (vfloat)exponent_bits;
}

#endif
