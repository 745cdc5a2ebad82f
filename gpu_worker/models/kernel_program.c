/*
 * A list of kernel calls run in order by one call from Python: a step's norms, projections, rotary, KV
 * writes and attention, where each would otherwise be a ctypes call of its own (1.5 us apiece,
 * ~45 a step on a 4-layer model, ~300 on a 30-layer one).
 *
 * Owns nothing but the calling: which kernel takes which arguments is the kernels' own business, and
 * what they compute their libraries'. Knows nothing of Python or torch.
 *
 * How it works: a program is an array of records of PROGRAM_RECORD_WORDS int64 words. A record's
 * first word names its signature (an index into SIGNATURES), the second is the kernel's address, and
 * the rest its arguments in order, one word each: an int or an int64 as itself, a pointer as its
 * address, a float as its IEEE bits in the low 32 bits. Each signature's caller casts the address to
 * the kernel's prototype (every pointer as void *, which the ABI passes as it passes any other object
 * pointer) and the words to its parameters' types, as a C call to it would.
 * kernel_program.py spells a kernel's ctypes argtypes the way SIGNATURES does ("p" a pointer, "l" an
 * int64, "i" an int, "f" a float) and asks pagedserve_program_signature for the index; a kernel whose
 * spelling is not here is called from Python instead.
 */

#include <stdint.h>
#include <string.h>

#define PROGRAM_RECORD_WORDS 32

const int32_t pagedserve_program_record_words = PROGRAM_RECORD_WORDS;

typedef int64_t word;
typedef int (*signature_caller)(const word *record);

static float real(word w)
{
    uint32_t bits = (uint32_t)w;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#define P(n) ((void *)(intptr_t)r[2 + (n)])
#define L(n) (r[2 + (n)])
#define I(n) ((int)r[2 + (n)])
#define F(n) real(r[2 + (n)])
#define KERNEL(...) ((int (*)(__VA_ARGS__))(intptr_t)r[1])

/* cpu_linear.c: pagedserve_linear (float32 rows; float32, int8 or int4 weights). */
static int call_linear(const word *r)
{
    return KERNEL(void *, int64_t, int, void *, void *, int64_t, void *, void *, int64_t, int64_t, int64_t, int64_t,
                  int)(P(0), L(1), I(2), P(3), P(4), L(5), P(6), P(7), L(8), L(9), L(10), L(11), I(12));
}

/* cpu_linear.c: pagedserve_linear_pairs (a gated MLP's gate and up, and SiLU·up, in float32). */
static int call_linear_pairs(const word *r)
{
    return KERNEL(void *, int64_t, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int, int)(
        P(0), L(1), P(2), P(3), P(4), L(5), L(6), L(7), L(8), I(9), I(10));
}

/* cpu_linear_bf16.c: pagedserve_linear (bfloat16 rows and weights in pair tiles). */
static int call_pair_linear(const word *r)
{
    return KERNEL(void *, int64_t, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int)(
        P(0), L(1), P(2), P(3), P(4), L(5), L(6), L(7), L(8), I(9));
}

/* cpu_fused.c: pagedserve_rms_norm. */
static int call_rms_norm(const word *r)
{
    return KERNEL(int, void *, int64_t, void *, void *, int64_t, int64_t, int64_t, float, int)(
        I(0), P(1), L(2), P(3), P(4), L(5), L(6), L(7), F(8), I(9));
}

/* cpu_fused.c: pagedserve_add_rms_norm. */
static int call_add_rms_norm(const word *r)
{
    return KERNEL(int, void *, int64_t, void *, int64_t, void *, int64_t, int64_t, float, int)(
        I(0), P(1), L(2), P(3), L(4), P(5), L(6), L(7), F(8), I(9));
}

/* cpu_fused.c: pagedserve_silu_and_mul. */
static int call_silu_and_mul(const word *r)
{
    return KERNEL(int, void *, int64_t, void *, int64_t, int64_t, int64_t, int)(I(0), P(1), L(2), P(3), L(4), L(5),
                                                                              L(6), I(7));
}

/* cpu_fused.c: pagedserve_apply_rotary. */
static int call_apply_rotary(const word *r)
{
    return KERNEL(int, void *, int64_t, int64_t, void *, void *, int64_t, int64_t, int64_t, int)(
        I(0), P(1), L(2), L(3), P(4), P(5), L(6), L(7), L(8), I(9));
}

/* cpu_fused.c: pagedserve_write_kv. */
static int call_write_kv(const word *r)
{
    return KERNEL(int, void *, int64_t, void *, int64_t, void *, void *, void *, int64_t, int64_t, int64_t)(
        I(0), P(1), L(2), P(3), L(4), P(5), P(6), P(7), L(8), L(9), L(10));
}

/* cpu_decode.c: pagedserve_decode_attention. */
static int call_decode_attention(const word *r)
{
    return KERNEL(int, int, void *, int64_t, int64_t, void *, int64_t, int64_t, void *, void *, int64_t, int64_t,
                  int64_t, int64_t, int64_t, int64_t, void *, int64_t, int64_t, void *, void *, int64_t, void *,
                  int64_t, float, int, void *)(
        I(0), I(1), P(2), L(3), L(4), P(5), L(6), L(7), P(8), P(9), L(10), L(11), L(12), L(13), L(14), L(15),
        P(16), L(17), L(18), P(19), P(20), L(21), P(22), L(23), F(24), I(25), P(26));
}

/* cpu_prefill.c: pagedserve_prefill_attention. */
static int call_prefill_attention(const word *r)
{
    return KERNEL(int, void *, int64_t, int64_t, void *, int64_t, int64_t, void *, void *, int64_t, int64_t, int64_t,
                  int64_t, int64_t, int64_t, void *, int64_t, int64_t, void *, void *, int64_t, void *, int64_t, float,
                  int, void *)(
        I(0), P(1), L(2), L(3), P(4), L(5), L(6), P(7), P(8), L(9), L(10), L(11), L(12), L(13), L(14), P(15), L(16),
        L(17), P(18), P(19), L(20), P(21), L(22), F(23), I(24), P(25));
}

static const struct {
    const char *spelling;
    signature_caller call;
} SIGNATURES[] = {
    {"plipplpplllli", call_linear},
    {"plpppllllii", call_linear_pairs},
    {"plppplllli", call_pair_linear},
    {"iplpplllfi", call_rms_norm},
    {"iplplpllfi", call_add_rms_norm},
    {"iplpllli", call_silu_and_mul},
    {"ipllppllli", call_apply_rotary},
    {"iplplppplll", call_write_kv},
    {"iipllpllppllllllpllpplplfip", call_decode_attention},
    {"ipllpllppllllllpllpplplfip", call_prefill_attention},
};

enum { NUM_SIGNATURES = sizeof SIGNATURES / sizeof SIGNATURES[0] };
enum { STATUS_BAD_SIGNATURE = -1 };

/* The index of the signature spelled so, or -1 when no caller here has its prototype. */
int pagedserve_program_signature(const char *spelling)
{
    for (int i = 0; i < NUM_SIGNATURES; i++)
        if (strcmp(SIGNATURES[i].spelling, spelling) == 0)
            return i;
    return -1;
}

/*
 * Run records first..last-1 of the program in order. Stops at the first that returns a non-zero status
 * (or names no signature here: STATUS_BAD_SIGNATURE) and returns that status with *failed set to its
 * index; 0 when all ran.
 */
int pagedserve_run_program(const word *program, int64_t first, int64_t last, int64_t *failed)
{
    for (int64_t i = first; i < last; i++) {
        const word *record = program + i * PROGRAM_RECORD_WORDS;
        int status = record[0] >= 0 && record[0] < NUM_SIGNATURES ? SIGNATURES[record[0]].call(record)
                                                                    : STATUS_BAD_SIGNATURE;
        if (status) {
            *failed = i;
            return status;
        }
    }
    return 0;
}
