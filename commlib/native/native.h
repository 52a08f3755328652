/* The compiled host loops (the extension module commlib._hostloops, loaded
 * by commlib/ops/_native.py).
 * Each function trusts its arguments: module.c checks them. The loops over
 * spans use no Python API: module.c runs them without the GIL. */
#ifndef COMMLIB_NATIVE_H
#define COMMLIB_NATIVE_H

#include "arrays.h"

/* hostcopy.c */
void commlib_copy(const commlib_span *spans, Py_ssize_t n, char *flat, int to_arrays,
                  Py_ssize_t skip_begin, Py_ssize_t skip_end, Py_ssize_t total, int streaming);

/* hostreduce.c */
/* float16 and bfloat16 (uint16 bits) are reduced as commlib_cast does:
 * both sides widened to float32, the op there, rounded back to nearest even
 * with the canonical NaN, at every step in rank order. */
enum { COMMLIB_T_FLOAT32, COMMLIB_T_FLOAT64, COMMLIB_T_INT32, COMMLIB_T_INT64,
       COMMLIB_T_UINT8, COMMLIB_T_FLOAT16, COMMLIB_T_BFLOAT16, COMMLIB_T_COUNT };
enum { COMMLIB_OP_SUM, COMMLIB_OP_PROD, COMMLIB_OP_MAX, COMMLIB_OP_MIN, COMMLIB_OP_COUNT };
Py_ssize_t commlib_reduce_share(const commlib_span *spans, Py_ssize_t n, Py_ssize_t itemsize,
                                int type, int op, char *const *slots, int nranks, int rank,
                                char *result, Py_ssize_t begin, Py_ssize_t end, double scale,
                                int scaled, int streaming, int cast_own, float own_scale,
                                Py_ssize_t *found);

/* flag_wait.c: a wait returns COMMLIB_WAIT_DONE when every rank arrived,
 * COMMLIB_WAIT_LATER once `until` (CLOCK_MONOTONIC seconds) has passed, or
 * the rank r >= 0 that has left (COMMLIB_WAIT_GONE(r)). */
#define COMMLIB_WAIT_DONE (-1)
#define COMMLIB_WAIT_LATER (-2)
#define COMMLIB_BOARD_DIFFER (-3)
#define COMMLIB_WAIT_GONE(r) (r)
/* Indices into the `at` array of commlib_board_enter: word offsets within a
 * rank's line of the sequence number entered, the gone-at sequence number
 * and the first fingerprint slot (two slots of COMMLIB_BOARD_SLOT_WORDS). */
enum { COMMLIB_BOARD_ENTERED, COMMLIB_BOARD_GONE, COMMLIB_BOARD_SLOT, COMMLIB_BOARD_AT_COUNT };
#define COMMLIB_BOARD_SLOT_WORDS 4

/* Wait until words[r * stride] >= target for every rank r != rank; give up
 * when such a rank has 0 < gone[r * gone_stride] <= seq (gone may be NULL). */
int commlib_wait_all(const volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                     int64_t target, const volatile int64_t *gone, Py_ssize_t gone_stride,
                     int64_t seq, double until);

/* The shared-memory reducer's synchronisation: on the `first` slice of a
 * wait publish `seq` at flags[rank * stride] (release order), then wait for
 * every rank's. */
int commlib_wait_flags(volatile int64_t *flags, int rank, int nranks, Py_ssize_t stride,
                       int64_t seq, int first, double until, const volatile int64_t *gone,
                       Py_ssize_t gone_stride, int64_t board_seq);

/* The status board's entry into collective `seq`: publish this rank's
 * fingerprint slot (when `publishing`) and then `seq`, wait for every rank
 * to enter `seq`, and compare the first two words of every rank's slot
 * (COMMLIB_BOARD_DIFFER when they differ). */
int commlib_board_enter(volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                        const Py_ssize_t *at, int64_t seq, const int64_t *slot, int publishing,
                        double until);

/* hostcast.c: formats and operations of commlib_cast */
enum { CAST_F32, CAST_F16, CAST_BF16 };
enum { CAST_OP_NONE, CAST_OP_SUM, CAST_OP_PROD, CAST_OP_MAX, CAST_OP_MIN };
enum { COMMLIB_CAST_PORTABLE, COMMLIB_CAST_AVX2 };
/* dst[i] = narrow(op(widen(dst[i]), scale * widen(src[i]))) for i < n (see
 * hostcast_block.h); returns the number of non-finite values written.
 * `streaming`: float32 to a half format with no op writes dst with
 * non-temporal stores where the CPU has them (memory another core reads
 * next: see streaming.h), the same values. */
Py_ssize_t commlib_cast(const void *src, int sfmt, void *dst, int dfmt, Py_ssize_t n,
                        float scale, int scaled, int op, int streaming);
/* The rank-order sum of a half-format share with this rank's part rounded
 * from float32 (see hostcast_block.h's _sum_own): the count of elements it
 * did from the start (a multiple of eight; 0 without AVX2 and F16C). */
Py_ssize_t commlib_half_sum_own(const float *own, float scale, int scaled, char *const *slots,
                                int nranks, int rank, Py_ssize_t at, uint16_t *out, int fmt,
                                Py_ssize_t n, Py_ssize_t *sent, Py_ssize_t *found);
/* The number of inf and NaN among n values of format fmt. */
Py_ssize_t commlib_count_nonfinite(const void *data, int fmt, Py_ssize_t n);
/* The code path of commlib_cast: level >= 0 chooses min(level, the best
 * this CPU runs); returns the path in use. */
int commlib_cast_level(int level);

/* hostselect.c (commlib/ops/hostselect.py); x, values: float32, indices: int32 */
/* Top-k by magnitude as commlib/ops/topk.py's numpy twin: residual (or
 * NULL) += x first and selection runs on it, selected entries then zeroed
 * in it. Writes kk entries (ascending index, then padding -1 / 0); returns
 * the number selected, or -1 when out of memory. */
Py_ssize_t commlib_topk(const float *x, float *residual, Py_ssize_t n, Py_ssize_t kk,
                        int32_t *indices, float *values);
/* commlib_accumulate_finite(residual, x, acc, n) (its count into
 * *nonfinite), then commlib_topk(acc, NULL, n, kk, ...), in one pass over
 * the data when a sampled bound holds. */
Py_ssize_t commlib_topk_accumulate(const float *residual, const float *x, float *acc,
                                   Py_ssize_t n, Py_ssize_t kk, int32_t *indices,
                                   float *values, Py_ssize_t *nonfinite);
/* Entries with |x| > the float32 of magnitude bits `tkey` (NaN never), in
 * ascending order, at most `capacity` written; returns how many qualify. */
Py_ssize_t commlib_threshold(const float *x, Py_ssize_t n, uint32_t tkey, int32_t *indices,
                             float *values, Py_ssize_t capacity);
/* commlib_accumulate_finite(residual, x, acc, n) (its count into
 * *nonfinite), then commlib_threshold(acc, ...), in one pass. */
Py_ssize_t commlib_threshold_accumulate(const float *residual, const float *x, float *acc,
                                        Py_ssize_t n, uint32_t tkey, int32_t *indices,
                                        float *values, Py_ssize_t capacity,
                                        Py_ssize_t *nonfinite);
/* dense[indices[i]] += alpha * values[i] in order; -1 skipped; returns the
 * number of other indices outside [0, n), which are skipped. */
Py_ssize_t commlib_scatter_add(float *dense, Py_ssize_t n, const int32_t *indices,
                               const float *values, Py_ssize_t m, float alpha);
/* dense = 0, then the scatter-add of (indices, values), then dense *=
 * scale when `scaled` (only the entries written, where that gives the same
 * bits: scale not negative); returns the out-of-range count, or -1 when out
 * of memory. */
Py_ssize_t commlib_sparse_sum(float *dense, Py_ssize_t n, const int32_t *indices,
                              const float *values, Py_ssize_t m, float scale, int scaled);
/* acc = residual + x (acc = x when residual is NULL), then non-finite
 * entries of acc set to 0; returns how many there were. */
Py_ssize_t commlib_accumulate_finite(const float *residual, const float *x, float *acc,
                                     Py_ssize_t n);

#endif
