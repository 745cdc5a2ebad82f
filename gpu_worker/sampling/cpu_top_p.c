/*
 * Top-p (nucleus) sampling's cutoff on the CPU: for each row of float32 probabilities, the probability of
 * the least likely token top-p keeps (nucleus.h finds it without sorting the row), and, when asked, the
 * row's logits set to -inf below it.
 *
 * Owns the kernel's entry point. Knows nothing of Python or of the other filters: top_p.py checks the
 * tensors and hands over raw pointers, the row strides (in elements) and the sizes, checked again here.
 * Rows are split between OpenMP threads, as many as the caller asks for.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "nucleus.h"

enum { STATUS_OK = 0, STATUS_BAD_SIZES = 1, STATUS_NO_MEMORY = 2 };

/* Sets logits to -inf where the row's probability is below its cutoff (never where the cutoff is NaN). */
static void exclude_below(float *logits, const float *probs, int64_t vocab_size, float cutoff)
{
    for (int64_t i = 0; i < vocab_size; i++)
        logits[i] = probs[i] < cutoff ? -INFINITY : logits[i];
}

/* With `logits` (NULL for none), each row's tokens below its cutoff are also excluded there, while the row
 * is still in cache: the filter's whole job in one call. */
int pagedserve_top_p_cutoff(const float *probs, int64_t row_stride, int64_t num_rows, int64_t vocab_size,
                            const float *top_p, float *cutoffs, float *logits, int64_t logits_stride,
                            int num_threads)
{
    if (num_rows < 0 || vocab_size < 1 || row_stride < vocab_size || num_threads < 1
        || (logits && logits_stride < vocab_size))
        return STATUS_BAD_SIZES;
    int status = STATUS_OK;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc((size_t)vocab_size * sizeof *scratch);
        if (!scratch) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++)
            if (scratch) {
                cutoffs[r] = row_cutoff(probs + r * row_stride, vocab_size, top_p[r], scratch);
                if (logits)
                    exclude_below(logits + r * logits_stride, probs + r * row_stride, vocab_size, cutoffs[r]);
            }
        free(scratch);
    }
    return status;
}
