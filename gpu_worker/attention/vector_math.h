/*
 * Vector helpers of the CPU attention kernels: vectors of LANES floats, bfloat16 widening and
 * rounding, lane reductions and a base-2 exponential.
 *
 * Owns arithmetic on vectors only; knows nothing of caches, metadata or attention. Vectors are GCC
 * vector extensions, not one instruction set's intrinsics, as wide as the build's registers: 16
 * floats where it has AVX-512, else 8 (one AVX2 register, two SSE ones). A vector wider than the
 * registers is split by the compiler into several, and the kernels then ran below torch's speed. exp2 is a polynomial the compiler vectorises (libm's is a call
 * per element without -ffast-math, which a shared library must not use: it would switch the whole
 * process to flush-to-zero).
 */

#ifndef PAGEDSERVE_VECTOR_MATH_H
#define PAGEDSERVE_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#if defined(__AVX512F__)
#define LANES 16 /* floats per vector; the shuffles below are written for 16 and for 8 */
#else
#define LANES 8
#endif

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vbf16 __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline vfloat broadcast(float x)
{
    return (vfloat){0} + x;
}

/* Lane i holds i. */
static inline vint lane_indices(void)
{
#if LANES == 16
    return (vint){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    return (vint){0, 1, 2, 3, 4, 5, 6, 7};
#endif
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

/* The vector with its halves, quarters, ... swapped: lane i takes lane i ^ width (width a power of
 * two below LANES), the partner a fold adds or compares. */
#if LANES == 16
#define SWAP_8(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP_4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP_2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP_1(v) __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#else
#define SWAP_4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)
#define SWAP_2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5)
#define SWAP_1(v) __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6)
#endif

/* Halves folded onto each other: (8 + 8,) 4 + 4, 2 + 2, 1 + 1 lanes. */
static inline float lane_max(vfloat v)
{
#if LANES == 16
    v = max_lanes(v, SWAP_8(v));
#endif
    v = max_lanes(v, SWAP_4(v));
    v = max_lanes(v, SWAP_2(v));
    v = max_lanes(v, SWAP_1(v));
    return v[0];
}

static inline float lane_sum(vfloat v)
{
#if LANES == 16
    v += SWAP_8(v);
#endif
    v += SWAP_4(v);
    v += SWAP_2(v);
    v += SWAP_1(v);
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
