/*
 * SiLU(gate) * up on vectors of LANES floats, in one place for the two kernels that compute it in float32:
 * the per-row op (cpu_fused.c) and the gate and up projection's epilogue (cpu_linear.c), which must agree
 * to the bit, since a step through either is checked against the other.
 *
 * The includer defines LANES, vfloat and vint (GCC vector extensions of LANES floats and int32s). exp is a
 * polynomial the compiler vectorises: libm's expf is a call per element without -ffast-math, which a shared
 * library must not use (it would switch the whole process to flush-to-zero).
 */

#ifndef PAGEDSERVE_SILU_LANES_H
#define PAGEDSERVE_SILU_LANES_H

/* exp's constants, shared by cpu_fused.c's scalar exp_poly and the vectors below. */
static const float EXP_LOG2E = 1.44269504f, EXP_LN2_HI = 0.693145752f, EXP_LN2_LO = 1.42860677e-06f;
static const float EXP_ROUND_MAGIC = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
static const float EXP_OVERFLOW = 88.7228394f;    /* log(FLT_MAX) */
/* e^r for |r| <= ln2 / 2, Horner's degree-7 Taylor polynomial; r a float or a vfloat (the same operations). */
#define EXP_TAYLOR_7(r)                                                                                            \
    ({                                                                                                             \
        __typeof__(r) r_ = (r);                                                                                    \
        ((((((r_ * (1.0f / 5040.0f) + 1.0f / 720.0f) * r_ + 1.0f / 120.0f) * r_ + 1.0f / 24.0f) * r_ + 1.0f / 6.0f) \
              * r_ + 0.5f) * r_ + 1.0f) * r_ + 1.0f;                                                               \
    })

/* Each lane of if_set where mask is set, else of if_clear. */
static inline vfloat silu_select(vint mask, vfloat if_set, vfloat if_clear)
{
    return (vfloat)(((vint)if_set & mask) | ((vint)if_clear & ~mask));
}

/* e^x in every lane: 2^n from the exponent bits times EXP_TAYLOR_7 of r, x = n ln2 + r, |r| <= ln2 / 2
 * (truncation error < 1e-8 relative, below float32 rounding). Past float32's range infinite, as expf is;
 * below -87 it stays e^-87, which next to the 1 SiLU adds is nothing. */
static inline vfloat exp_poly_lanes(vfloat x)
{
    vint is_overflow = x > EXP_OVERFLOW;
    x = silu_select(x < -87.0f, (vfloat){0} - 87.0f, silu_select(x > 88.0f, (vfloat){0} + 88.0f, x));
    vfloat n = (x * EXP_LOG2E + EXP_ROUND_MAGIC) - EXP_ROUND_MAGIC;
    vfloat p = EXP_TAYLOR_7((x - n * EXP_LN2_HI) - n * EXP_LN2_LO);
    vfloat scale = (vfloat)((__builtin_convertvector(n, vint) + 127) << 23);
    return silu_select(is_overflow, (vfloat){0} + INFINITY, p * scale);
}

/* silu(gate) * up, lane by lane. */
static inline vfloat silu_times_lanes(vfloat gate, vfloat up)
{
    return gate / (1.0f + exp_poly_lanes(-gate)) * up;
}

#endif
