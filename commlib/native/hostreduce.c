/* This rank's share of a shared-memory all-reduce, read straight from the
 * caller's arrays (commlib/ops/hostreduce.py, commlib/transport/shm.py). */
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "streaming.h"

enum { T_FLOAT32 = COMMLIB_T_FLOAT32, T_FLOAT64 = COMMLIB_T_FLOAT64,
       T_INT32 = COMMLIB_T_INT32, T_INT64 = COMMLIB_T_INT64,
       T_FLOAT16 = COMMLIB_T_FLOAT16, T_BFLOAT16 = COMMLIB_T_BFLOAT16 };
enum { OP_SUM = COMMLIB_OP_SUM, OP_PROD = COMMLIB_OP_PROD, OP_MAX = COMMLIB_OP_MAX };

/* numpy's semantics: integers wrap (computed unsigned, so no undefined
 * overflow); maximum/minimum return a NaN operand, the first if both are. */
#define MAX_FLOAT(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))
#define MIN_FLOAT(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))
#define MAX_INT(a, b) ((a) >= (b) ? (a) : (b))
#define MIN_INT(a, b) ((a) <= (b) ? (a) : (b))

#define ELEMENTWISE(T, EXPR)                           \
    for (Py_ssize_t j = 0; j < len; ++j) {              \
        T a = x[j], b = y[j];                           \
        out[j] = (EXPR);                                \
    }

/* out[j] = op(x[j], y[j]) for j < len; out may be x. U: T's arithmetic type. */
#define DEFINE_COMBINE(NAME, T, U, MAX, MIN)                                        \
    static void combine_##NAME(int op, T *out, const T *x, const T *y, Py_ssize_t len) \
    {                                                                               \
        switch (op) {                                                               \
        case OP_SUM: ELEMENTWISE(T, (T)((U)a + (U)b)) break;                        \
        case OP_PROD: ELEMENTWISE(T, (T)((U)a * (U)b)) break;                       \
        case OP_MAX: ELEMENTWISE(T, MAX(a, b)) break;                               \
        default: ELEMENTWISE(T, MIN(a, b)) break;                                   \
        }                                                                           \
    }

DEFINE_COMBINE(float32, float, float, MAX_FLOAT, MIN_FLOAT)
DEFINE_COMBINE(float64, double, double, MAX_FLOAT, MIN_FLOAT)
DEFINE_COMBINE(int32, int32_t, uint32_t, MAX_INT, MIN_INT)
DEFINE_COMBINE(int64, int64_t, uint64_t, MAX_INT, MIN_INT)
DEFINE_COMBINE(uint8, uint8_t, uint32_t, MAX_INT, MIN_INT)

/* float16 / bfloat16: out = narrow(op(widen(x), widen(y))) by commlib_cast
 * (hostcast.c), whose operation codes follow the host reduction's. */
static void combine_half(int type, int op, char *out, const char *x, const char *y,
                         Py_ssize_t len)
{
    static const int cast_ops[] = {CAST_OP_SUM, CAST_OP_PROD, CAST_OP_MAX, CAST_OP_MIN};
    const int fmt = type == T_FLOAT16 ? CAST_F16 : CAST_BF16;
    if (out != x)
        memcpy(out, x, (size_t)len * 2);
    commlib_cast(y, fmt, out, fmt, len, 1.0f, 0, cast_ops[op], 0);
}

static void combine(int type, int op, char *out, const char *x, const char *y, Py_ssize_t len)
{
    switch (type) {
    case T_FLOAT16: case T_BFLOAT16: combine_half(type, op, out, x, y, len); break;
    case T_FLOAT32: combine_float32(op, (float *)out, (const float *)x, (const float *)y, len); break;
    case T_FLOAT64: combine_float64(op, (double *)out, (const double *)x, (const double *)y, len); break;
    case T_INT32: combine_int32(op, (int32_t *)out, (const int32_t *)x, (const int32_t *)y, len); break;
    case T_INT64: combine_int64(op, (int64_t *)out, (const int64_t *)x, (const int64_t *)y, len); break;
    default: combine_uint8(op, (uint8_t *)out, (const uint8_t *)x, (const uint8_t *)y, len); break;
    }
}

/* out[j] *= scale, in the element type (as numpy's `out *= scale`; the half
 * formats widened, scaled in float32 and rounded back, as commlib_cast). */
static void scale_floats(int type, char *out, Py_ssize_t len, double scale)
{
    if (type == T_FLOAT16 || type == T_BFLOAT16) {
        const int fmt = type == T_FLOAT16 ? CAST_F16 : CAST_BF16;
        commlib_cast(out, fmt, out, fmt, len, (float)scale, 1, CAST_OP_NONE, 0);
    } else if (type == T_FLOAT32) {
        float s = (float)scale, *o = (float *)out;
        for (Py_ssize_t j = 0; j < len; ++j)
            o[j] *= s;
    } else if (type == T_FLOAT64) {
        double *o = (double *)out;
        for (Py_ssize_t j = 0; j < len; ++j)
            o[j] *= scale;
    }
}

/* Bytes reduced at a time in a private scratch buffer that stays in L1. */
#define SCRATCH_BYTES 16384

/* Reduce elements [begin, end) of a bucket of `nranks` ranks' contributions
 * (bounds in bytes of the element type).
 *
 * Rank q's contribution is slots[q] (each a flat buffer of the whole bucket)
 * for q != rank, and the concatenation of `spans` (this rank's own `n`
 * arrays, at least `end` bytes' worth of elements together) for q == rank.
 * Each element becomes op(...op(op(x0, x1), x2)..., x(n-1)) in rank
 * order, times `scale` when `scaled` (floating types), and is written
 * to `result` (at the same offset; with streaming stores when `streaming`,
 * see streaming.h) and back into this rank's arrays. `type` and `op` are
 * the enums of native.h.
 *
 * `cast_own` (the half formats only): this rank's arrays hold float32;
 * each value times `own_scale` is rounded to the half format (as
 * commlib_cast into a slot would) before it takes part, and the arrays
 * are not written. Returns the number of NaN and inf that rounding gave,
 * and sets `*found` to the number of NaN and inf written to `result`
 * (0 for both without `cast_own`). */
Py_ssize_t commlib_reduce_share(const commlib_span *spans, Py_ssize_t n, Py_ssize_t itemsize,
                                int type, int op, char *const *slots, int nranks, int rank,
                                char *result, Py_ssize_t begin, Py_ssize_t end, double scale,
                                int scaled, int streaming, int cast_own, float own_scale,
                                Py_ssize_t *found)
{
    _Alignas(64) char scratch[SCRATCH_BYTES];
    _Alignas(64) char narrowed[SCRATCH_BYTES];
    const int fmt = type == T_FLOAT16 ? CAST_F16 : CAST_BF16;
    const Py_ssize_t own_size = cast_own ? 4 : itemsize, step = SCRATCH_BYTES / itemsize;
    const Py_ssize_t first = begin / itemsize, last = end / itemsize;
    Py_ssize_t at = 0, sent = 0, nonfinite = 0;      /* in elements */
    for (Py_ssize_t i = 0; i < n && at < last; ++i) {
        Py_ssize_t count = spans[i].bytes / own_size;
        Py_ssize_t lo = at > first ? at : first, hi = at + count < last ? at + count : last;
        for (; lo < hi; lo += step) {
            Py_ssize_t len = hi - lo < step ? hi - lo : step, bytes = len * itemsize;
            char *own = spans[i].data + (lo - at) * own_size;
            /* a sum cast from float32: eight at a time in one vector pass */
            Py_ssize_t done = cast_own && op == OP_SUM && !scaled
                ? commlib_half_sum_own((const float *)own, own_scale, own_scale != 1.0f, slots,
                                       nranks, rank, lo, (uint16_t *)scratch, fmt, len, &sent,
                                       &nonfinite)
                : 0;
            Py_ssize_t rest = len - done, from = (lo + done) * itemsize;
            char *acc = scratch + done * itemsize;
            const char *mine = own + done * own_size;
            if (rest > 0 && cast_own) {
                sent += commlib_cast(mine, CAST_F32, narrowed, fmt, rest, own_scale,
                                     own_scale != 1.0f, CAST_OP_NONE, 0);
                mine = narrowed;
            }
            if (rest > 0) {
                combine(type, op, acc, rank == 0 ? mine : slots[0] + from,
                        rank == 1 ? mine : slots[1] + from, rest);
                for (int q = 2; q < nranks; ++q)
                    combine(type, op, acc, acc, q == rank ? mine : slots[q] + from, rest);
                if (scaled)
                    scale_floats(type, acc, rest, scale);
                if (cast_own)
                    nonfinite += commlib_count_nonfinite(acc, fmt, rest);
            }
            if (!cast_own)
                memcpy(own, scratch, (size_t)bytes);
            copy_out(result + lo * itemsize, scratch, (size_t)bytes, streaming);
        }
        at += count;
    }
    streaming_fence(streaming);
    *found = nonfinite;
    return sent;
}
