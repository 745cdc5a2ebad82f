/*
 * Top-p's cutoff for one row of float32 probabilities, found without sorting the row: `row_cutoff`, which
 * the top-p kernel (cpu_top_p.c) runs on rows of probabilities and the draw kernel (cpu_draw.c) on the
 * probabilities it computes itself.
 *
 * The rule is filters.py's, which sorts: in descending order a token is kept while the mass of the tokens
 * before it, summed in double and rounded to float32, is below top_p, and the first token always is. Its
 * cutoff is therefore the smallest probability v of the row whose mass above, A(v) = the sum of the
 * probabilities greater than v, rounds below top_p (the row's largest when none does). Summed in double,
 * float32 probabilities of at least 2**-30 add up exactly in any order, so A does not depend on the order
 * the tokens are visited in.
 *
 * How it works: a probability's bits order like its value (all are >= 0), so the row is bucketed by its
 * top 10 bits, with each bucket's count and sum. Walking down from the largest bucket, the mass above a
 * bucket's largest member is the sum of the buckets above it; the cutoff lies in the lowest non-empty
 * bucket where that mass still rounds below top_p. That bucket is bucketed again by the next 11 bits the
 * same way, and the few probabilities left sharing 21 bits are sorted and walked one by one. Three passes
 * over the row (the largest value first, which bounds the buckets in use; the last gathers the bucket's
 * members, which the second level and the sort then read alone) where the sort took a dozen:
 * torch's sort of 64 rows of a 4,096-token vocabulary costs 4 ms a step on two cores.
 *
 * A row holding a NaN or a negative value (softmax gives a row of NaN for logits all NaN or all -inf) has
 * no cutoff: NaN, as the sort gives, which excludes nothing.
 */

#ifndef PAGEDSERVE_NUCLEUS_H
#define PAGEDSERVE_NUCLEUS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LEVEL1_SHIFT = 21, LEVEL1_BUCKETS = 1 << 10, LEVEL1_LANES = 4, LEVEL2_SHIFT = 10, LEVEL2_BUCKETS = 1 << 11 };

static uint32_t bits_of(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The lowest non-empty bucket, walking down, whose mass above still rounds below top_p; -1 when even the
 * first non-empty bucket's does not. *mass_above is set to that bucket's mass above. */
static int64_t find_bucket(const int64_t *counts, const double *sums, int64_t num_buckets, float top_p,
                           double *mass_above)
{
    int64_t found = -1;
    double mass = *mass_above;
    for (int64_t b = num_buckets - 1; b >= 0; b--) {
        if (!counts[b])
            continue;
        if (!((float)mass < top_p))
            break;
        found = b;
        *mass_above = mass;
        mass += sums[b];
    }
    return found;
}

static int descending(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static float row_cutoff(const float *row, int64_t vocab_size, float top_p, float *scratch)
{
    int64_t counts1[LEVEL1_BUCKETS], counts2[LEVEL2_BUCKETS] = {0};
    double sums1[LEVEL1_BUCKETS], sums2[LEVEL2_BUCKETS] = {0};
    int32_t lane_counts[LEVEL1_LANES][LEVEL1_BUCKETS];
    double lane_sums[LEVEL1_LANES][LEVEL1_BUCKETS];
    uint32_t largest_bits = 0; /* a probability's bits order like its value; a negative value's or NaN's are
                                * above +inf's */
    for (int64_t i = 0; i < vocab_size; i++) {
        uint32_t bits = bits_of(row[i]);
        largest_bits = bits > largest_bits ? bits : largest_bits;
    }
    if (largest_bits > 0x7F800000u)
        return NAN; /* not probabilities (a row whose logits were all NaN or -inf): as the sort, no cutoff */
    float largest;
    memcpy(&largest, &largest_bits, sizeof largest);
    /* Only the buckets up to the largest value's are used (509 of them for probabilities up to 1): only they
     * are cleared and walked. */
    int64_t num_buckets1 = (int64_t)(largest_bits >> LEVEL1_SHIFT) + 1;
    for (int lane = 0; lane < LEVEL1_LANES; lane++) {
        memset(lane_counts[lane], 0, (size_t)num_buckets1 * sizeof lane_counts[lane][0]);
        memset(lane_sums[lane], 0, (size_t)num_buckets1 * sizeof lane_sums[lane][0]);
    }
    /* Neighbouring tokens often share a bucket: counted in LEVEL1_LANES histograms by turns, so that one
     * token's count does not wait on the last one's. The sums are exact in any order (see above). */
    int64_t i = 0;
    for (; i + LEVEL1_LANES <= vocab_size; i += LEVEL1_LANES)
        for (int lane = 0; lane < LEVEL1_LANES; lane++) {
            uint32_t bucket = bits_of(row[i + lane]) >> LEVEL1_SHIFT;
            lane_counts[lane][bucket]++;
            lane_sums[lane][bucket] += row[i + lane];
        }
    for (; i < vocab_size; i++) {
        uint32_t bucket = bits_of(row[i]) >> LEVEL1_SHIFT;
        lane_counts[0][bucket]++;
        lane_sums[0][bucket] += row[i];
    }
    for (int64_t b = 0; b < num_buckets1; b++) {
        counts1[b] = 0;
        sums1[b] = 0.0;
        for (int lane = 0; lane < LEVEL1_LANES; lane++) {
            counts1[b] += lane_counts[lane][b];
            sums1[b] += lane_sums[lane][b];
        }
    }
    double mass_above = 0.0;
    int64_t bucket1 = find_bucket(counts1, sums1, num_buckets1, top_p, &mass_above);
    if (bucket1 < 0)
        return largest; /* top_p rounds to 0: the most likely token alone */
    /* The bucket's members, gathered in one pass without a branch (each value is stored, and kept by counting it
     * only when it belongs: a branch would mispredict on the members' scattered positions); the next level and
     * the sort then read them alone. */
    int64_t num_members = 0;
    for (int64_t i = 0; i < vocab_size; i++) {
        scratch[num_members] = row[i];
        num_members += (int64_t)(bits_of(row[i]) >> LEVEL1_SHIFT) == bucket1;
    }
    for (int64_t i = 0; i < num_members; i++) {
        uint32_t bucket = (bits_of(scratch[i]) >> LEVEL2_SHIFT) & (LEVEL2_BUCKETS - 1);
        counts2[bucket]++;
        sums2[bucket] += scratch[i];
    }
    int64_t bucket2 = find_bucket(counts2, sums2, LEVEL2_BUCKETS, top_p, &mass_above);
    uint32_t prefix = ((uint32_t)bucket1 << (LEVEL1_SHIFT - LEVEL2_SHIFT)) | (uint32_t)bucket2;
    int64_t num_left = 0;
    for (int64_t i = 0; i < num_members; i++) {
        float value = scratch[i];
        scratch[num_left] = value;
        num_left += bits_of(value) >> LEVEL2_SHIFT == prefix;
    }
    qsort(scratch, (size_t)num_left, sizeof *scratch, descending);
    float cutoff = scratch[0];
    for (int64_t i = 0; i < num_left; i++) {
        if (scratch[i] != cutoff) { /* a new, smaller value: its mass above is all that came before it */
            if (!((float)mass_above < top_p))
                break;
            cutoff = scratch[i];
        }
        mass_above += scratch[i];
    }
    return cutoff;
}

#endif
