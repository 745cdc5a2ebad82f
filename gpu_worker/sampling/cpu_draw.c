/*
 * The draw of sampled rows on the CPU: for each row of filtered float32 logits, the token that wins the
 * exponential race, argmax over v of logits[v] - log(E[v]), E the row's counter-based Exp(1) noise.
 *
 * Owns that race in one pass over the row. Knows nothing of Python or of the filters: sampler.py checks
 * the tensors and hands over raw pointers, the row stride (in elements), the sizes and each row's 64-bit
 * key, checked again here. The noise is noise.py's, element for element in its bits: token v's 32 random
 * bits are lowbias32(lowbias32((v + 1) * 0x9E3779B9 + key_low) ^ key_high), its uniform
 * u = (bits >> 9 + 0.5) / 2**23, and E = -log(u). torch computes the same thing in a dozen passes over
 * [rows, vocab] tensors (4 ms a step for 64 rows of a 4,096-token vocabulary on two cores); here the
 * noise is never stored, and a run of tokens the filters excluded (-inf, most of a row after top-p) is
 * skipped without computing theirs.
 *
 * The logarithm is this file's polynomial, within about 2 ulp of the true value, as torch's own CPU
 * logarithm is (a different polynomial for each instruction set): the draw's tokens are torch's except
 * where two tokens' races end within a few ulp of each other, the difference noise.py accepts between
 * devices. A row's token depends on its logits and key alone, never on the thread that draws it.
 *
 * Ties go to the lowest token id, as torch's argmax; a row of nothing but -inf draws token 0. The logits
 * must hold no NaN (filters.py maps NaN to -inf before any draw).
 *
 * `pagedserve_draw_filtered` takes rows that ask for temperature and top-p alone from their raw logits to
 * their token in one call: filters.py's temperature, then softmax (here, with vector_math.h's exponential),
 * top-p's cutoff (nucleus.h) and the race, each row in a thread's scratch rows while it is in cache.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../attention/vector_math.h"
#include "argmax_lanes.h"
#include "nucleus.h"

enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_NO_MEMORY = 2 };

static const uint32_t WEYL_STEP = 0x9E3779B9u;
static const uint32_t LOWBIAS_MULTIPLIERS[2] = {0x7FEB352Du, 0x846CA68Bu};
static const float UNIFORM_SCALE = 1.0f / (1 << 23);
/* ln 2 as a part with 12 significant bits (so that exponent * LN2_HIGH is exact) and the rest. */
static const float LN2_HIGH = 0.693359375f;
static const float LN2_LOW = -2.12194442e-4f;
static const float SQRT2 = 1.41421354f;
static const float LOG2_E = 1.44269504f;

static inline vuint lowbias32(vuint x)
{
    x = (x ^ (x >> 16)) * LOWBIAS_MULTIPLIERS[0];
    x = (x ^ (x >> 15)) * LOWBIAS_MULTIPLIERS[1];
    return x ^ (x >> 16);
}

/* log(x) for positive normal x: x = m * 2^e with m in [sqrt(1/2), sqrt(2)], and
 * log(m) = 2 atanh(t) = 2 (t + t^3/3 + t^5/5 + t^7/7 + t^9/9), t = (m - 1) / (m + 1), |t| <= 0.172,
 * where the next term is below float32's rounding. */
static inline vfloat log_positive(vfloat x)
{
    vuint bits = (vuint)x;
    vint exponent = (vint)(bits >> 23) - 127;
    vfloat mantissa = (vfloat)((bits & 0x007FFFFFu) | 0x3F800000u); /* in [1, 2) */
    vint is_high = mantissa > SQRT2;
    mantissa = select_lanes(is_high, mantissa * 0.5f, mantissa);
    exponent -= is_high; /* a true lane is -1 */
    vfloat t = (mantissa - 1.0f) / (mantissa + 1.0f);
    vfloat t2 = t * t;
    vfloat series = (((1.0f / 9) * t2 + 1.0f / 7) * t2 + 1.0f / 5) * t2 + 1.0f / 3;
    vfloat log_mantissa = 2.0f * t + (2.0f * t) * (t2 * series);
    vfloat e = __builtin_convertvector(exponent, vfloat);
    return e * LN2_HIGH + (e * LN2_LOW + log_mantissa);
}

/* The Exp(1) noise of LANES tokens under a key. */
static inline vfloat exponential_noise(vuint tokens, uint32_t key_low, uint32_t key_high)
{
    vuint bits = lowbias32(lowbias32((tokens + 1u) * WEYL_STEP + key_low) ^ key_high);
    vfloat uniform = (__builtin_convertvector(bits >> 9, vfloat) + 0.5f) * UNIFORM_SCALE; /* in (0, 1) */
    return -log_positive(uniform);
}

static inline vuint first_lanes(void)
{
    vuint lanes;
    for (int i = 0; i < LANES; i++)
        lanes[i] = (uint32_t)i;
    return lanes;
}

static inline int any_lane(vint mask)
{
    uint32_t folded = 0;
    for (int i = 0; i < LANES; i++)
        folded |= (uint32_t)mask[i];
    return folded != 0;
}

/* LANES logits from `first`, -inf past the end of the row. */
static inline vfloat load_padded(const float *row, int64_t first, int64_t vocab_size)
{
    if (first + LANES <= vocab_size)
        return load_floats(row + first);
    vfloat logits = broadcast(-INFINITY);
    memcpy(&logits, row + first, (size_t)(vocab_size - first) * sizeof(float));
    return logits;
}

static int64_t row_winner(const float *row, int64_t vocab_size, uint64_t key)
{
    uint32_t key_low = (uint32_t)key, key_high = (uint32_t)(key >> 32);
    vfloat best = broadcast(-INFINITY);
    vint best_token = (vint){0};
    vuint lane_tokens = first_lanes();
    for (int64_t first = 0; first < vocab_size; first += LANES) {
        vfloat logits = load_padded(row, first, vocab_size);
        if (!any_lane(logits > -INFINITY))
            continue; /* all excluded: none can win */
        vuint tokens = lane_tokens + (uint32_t)first;
        vfloat score = logits - log_positive(exponential_noise(tokens, key_low, key_high));
        vint wins = score > best; /* strict: a lane keeps its first best */
        best = select_lanes(wins, score, best);
        best_token = (vint)select_lanes(wins, (vfloat)tokens, (vfloat)best_token);
    }
    float top = -INFINITY;
    int64_t winner = -1;
    for (int i = 0; i < LANES; i++)
        if (best[i] > top || (best[i] == top && best_token[i] < winner)) {
            top = best[i];
            winner = best_token[i];
        }
    return top == -INFINITY ? 0 : winner;
}

int pagedserve_draw(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab_size,
                    const uint64_t *keys, int64_t *tokens, int num_threads)
{
    if (num_rows < 0 || vocab_size < 1 || vocab_size > INT32_MAX || row_stride < vocab_size || num_threads < 1)
        return STATUS_BAD_SIZES;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; r++)
        tokens[r] = row_winner(logits + r * row_stride, vocab_size, keys[r]);
    return STATUS_OK;
}

/* The greedy choice of a row: its largest logit's token, the lowest on ties, and NaN above everything (as
 * torch's argmax; a row of -inf picks token 0). One vectorised pass where torch's argmax takes a nanosecond a
 * logit. The pass keeps ARGMAX_CHAINS running bests, each over every ARGMAX_CHAINS-th vector of the row, so
 * that the comparisons of consecutive vectors do not wait on each other; each keeps its first best, and the
 * candidates of all of them are settled by value, then by the lowest token (argmax_lanes.h). */
enum { ARGMAX_CHAINS = 4 };

static int64_t row_argmax(const float *row, int64_t vocab_size)
{
    vfloat best[ARGMAX_CHAINS];
    vint best_token[ARGMAX_CHAINS];
    for (int c = 0; c < ARGMAX_CHAINS; c++) {
        best[c] = broadcast(-INFINITY);
        best_token[c] = (vint){0};
    }
    vint lane_tokens = (vint)first_lanes();
    int64_t first = 0;
    for (; first + ARGMAX_CHAINS * LANES <= vocab_size; first += ARGMAX_CHAINS * LANES)
        for (int c = 0; c < ARGMAX_CHAINS; c++)
            keep_best(load_floats(row + first + c * LANES), lane_tokens + (int32_t)(first + c * LANES), &best[c],
                      &best_token[c]);
    for (; first < vocab_size; first += LANES)
        keep_best(load_padded(row, first, vocab_size), lane_tokens + (int32_t)first, &best[0], &best_token[0]);
    float top;
    return settle_lanes(best, best_token, ARGMAX_CHAINS, &top);
}

int pagedserve_argmax(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab_size,
                      int64_t *tokens, int num_threads)
{
    if (num_rows < 0 || vocab_size < 1 || vocab_size > INT32_MAX || row_stride < vocab_size || num_threads < 1)
        return STATUS_BAD_SIZES;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; r++)
        tokens[r] = row_argmax(logits + r * row_stride, vocab_size);
    return STATUS_OK;
}

/* The row as filters.py leaves it before top-p, into `scaled`: NaN as -inf, +inf as the largest float, minus
 * the row's best (clamped to stay finite), over the temperature. The same float operations as torch's, so the
 * same values. */
static void temper(const float *row, int64_t vocab_size, float temperature, float *scaled)
{
    vfloat bests = broadcast(-INFINITY);
    int64_t v = 0;
    for (; v + LANES <= vocab_size; v += LANES) {
        vfloat x = load_floats(row + v);
        x = select_lanes(x != x, broadcast(-INFINITY), select_lanes(x == INFINITY, broadcast(FLT_MAX), x));
        store_floats(scaled + v, x);
        bests = max_lanes(bests, x);
    }
    float best = lane_max(bests);
    for (; v < vocab_size; v++) {
        float x = row[v];
        x = x != x ? -INFINITY : (x == INFINITY ? FLT_MAX : x);
        scaled[v] = x;
        best = x > best ? x : best;
    }
    best = best < -FLT_MAX ? -FLT_MAX : best;
    for (v = 0; v < vocab_size; v++)
        scaled[v] = (scaled[v] - best) / temperature;
}

/* e^x for x <= 0, 0 below 2^-126 (and for -inf). */
static inline vfloat exp_nonpositive(vfloat x)
{
    vfloat power = x * LOG2_E;
    return select_lanes(power > -126.0f, exp2_nonpositive(power), broadcast(0.0f));
}

/* softmax of a tempered row (its best at 0) into `probs`; NaN throughout when every token is -inf, as
 * torch's. */
static void softmax_of_tempered(const float *scaled, int64_t vocab_size, float *probs)
{
    vfloat sums = broadcast(0.0f);
    int64_t v = 0;
    for (; v + LANES <= vocab_size; v += LANES) {
        vfloat e = exp_nonpositive(load_floats(scaled + v));
        store_floats(probs + v, e);
        sums += e;
    }
    float sum = lane_sum(sums);
    for (; v < vocab_size; v++) {
        vfloat e = exp_nonpositive(broadcast(scaled[v]));
        probs[v] = e[0];
        sum += e[0];
    }
    float inverse_sum = 1.0f / sum;
    for (v = 0; v < vocab_size; v++)
        probs[v] = sum > 0.0f ? probs[v] * inverse_sum : NAN;
}

/* One row's temperature, top-p and race, with the thread's scratch rows. */
static int64_t filtered_winner(const float *row, int64_t vocab_size, float temperature, float top_p, uint64_t key,
                               float *scaled, float *probs, float *sort_scratch)
{
    temper(row, vocab_size, temperature, scaled);
    if (top_p <= 1.0f) {
        softmax_of_tempered(scaled, vocab_size, probs);
        float cutoff = row_cutoff(probs, vocab_size, top_p, sort_scratch);
        for (int64_t v = 0; v < vocab_size; v++)
            scaled[v] = probs[v] < cutoff ? -INFINITY : scaled[v];
    }
    return row_winner(scaled, vocab_size, key);
}

/* Temperature, top-p and the draw in one call, for rows that ask for no other filter: filters.py's
 * filter_logits then `pagedserve_draw`, with softmax's probabilities computed here (within a few ulp of
 * torch's, so top-p keeps the same tokens except one whose mass above ends within a few ulp of top_p).
 * temperature[r] must be a positive finite float (filters.py clamps it); a top_p[r] above 1 filters nothing. */
int pagedserve_draw_filtered(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab_size,
                             const float *temperature, const float *top_p, const uint64_t *keys, int64_t *tokens,
                             int num_threads)
{
    if (num_rows < 0 || vocab_size < 1 || vocab_size > INT32_MAX || row_stride < vocab_size || num_threads < 1)
        return STATUS_BAD_SIZES;
    int status = STATUS_OK;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(3 * (size_t)vocab_size * sizeof *scratch);
        if (!scratch) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++)
            if (scratch)
                tokens[r] = filtered_winner(logits + r * row_stride, vocab_size, temperature[r], top_p[r], keys[r],
                                            scratch, scratch + vocab_size, scratch + 2 * vocab_size);
        free(scratch);
    }
    return status;
}

/* What the race subtracts from each logit, written out: terms[r * vocab_size + v] = log(E) for key r and
 * token v (for tests to hold against noise.py's). */
int pagedserve_draw_terms(const uint64_t *keys, int64_t num_rows, int64_t vocab_size, float *terms)
{
    if (num_rows < 0 || vocab_size < 1 || vocab_size > INT32_MAX)
        return STATUS_BAD_SIZES;
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t first = 0; first < vocab_size; first += LANES) {
            vfloat values = log_positive(exponential_noise(first_lanes() + (uint32_t)first, (uint32_t)keys[r],
                                                           (uint32_t)(keys[r] >> 32)));
            int64_t count = vocab_size - first < LANES ? vocab_size - first : LANES;
            memcpy(terms + r * vocab_size + first, &values, (size_t)count * sizeof(float));
        }
    return STATUS_OK;
}
