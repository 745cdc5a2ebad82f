/*
 * A running argmax in vector lanes that gives torch's argmax's answer: the largest value's token, the lowest on
 * ties, NaN above everything (the first NaN). Each lane keeps the first best of the values it is shown, shown in
 * increasing token order; settle_lanes then picks among the lanes' bests by value, then by the lowest token.
 *
 * Owns those rules, for the greedy choice over a row of logits (cpu_draw.c) and for the linear kernels, which take
 * the LM head's argmax as they write its logits (cpu_linear.c, cpu_linear_bf16.c). The including source defines
 * LANES, vfloat and vint (LANES float32 and int32 lanes).
 */

#ifndef PAGEDSERVE_ARGMAX_LANES_H
#define PAGEDSERVE_ARGMAX_LANES_H

#include <stdint.h>

/* Each lane of `values` (their tokens in `tokens`) that beats the lane's best so far replaces it. */
static inline __attribute__((always_inline)) void keep_best(vfloat values, vint tokens, vfloat *best,
                                                            vint *best_token)
{
    vint wins = (values > *best) | ((values != values) & (*best == *best)); /* a lane keeps its first best */
    *best = (vfloat)(((vint)values & wins) | ((vint)*best & ~wins));
    *best_token = (tokens & wins) | (*best_token & ~wins);
}

/* Whether `value` beats `top` outright: larger, or NaN where top is not. */
static inline int beats(float value, float top)
{
    return value > top || (value != value && top == top);
}

/* The winner among the lanes of `count` vectors of bests: its token, and its value in *top. */
static inline int64_t settle_lanes(const vfloat *best, const vint *best_token, int count, float *top)
{
    float winner_value = best[0][0];
    int64_t winner = best_token[0][0];
    for (int c = 0; c < count; c++)
        for (int i = 0; i < LANES; i++) {
            float value = best[c][i];
            int64_t token = best_token[c][i];
            int ties = value == winner_value || (value != value && winner_value != winner_value);
            if (beats(value, winner_value) || (ties && token < winner)) {
                winner_value = value;
                winner = token;
            }
        }
    *top = winner_value;
    return winner;
}

#endif
