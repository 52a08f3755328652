/* Host selection loops of the sparse strategies (commlib/ops/hostselect.py):
 * top-k by magnitude, threshold compaction, scatter-add and the residual
 * accumulation, with the semantics of the numpy twins in
 * commlib/ops/{topk,threshold,sparse}.py, bit for bit.
 *
 * Magnitude keys are the float32 bits with the sign cleared: they order
 * like |x|, -0.0 ties with +0.0, NaN keys exceed INF_KEY.
 *
 * Top-k: a low bound from a strided sample of the keys (its rank chosen so
 * the bound lies below the k-th largest key with overwhelming probability,
 * as kernels/topk.cu does) lets one pass collect the few candidates in
 * ascending index order; a radix select among them finds the k-th largest
 * key, and the candidates above it, then the lowest-index ties, are the
 * result. When the sample misleads (too few or too many candidates) an
 * exact histogram of the keys' top 16 bits gives the bound instead: the
 * result never depends on the sample. Scans run in AVX2 where hostcast.c's
 * code path is AVX2 (commlib_cast_level), in portable C otherwise. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define INF_KEY 0x7F800000u
#define SAMPLES 8192
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SELECT_X86 1
#endif

/* x86-64 with GCC or clang: the residual accumulation is also compiled for
 * AVX2, chosen when the program loads (function multi-versioning). */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define SELECT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SELECT_CLONES
#endif
#define HIST_SHIFT 15

static inline uint32_t key_of(const uint32_t *bits, Py_ssize_t i)
{
    return bits[i] & 0x7FFFFFFFu;
}

/* The s-th largest (1 <= s <= m) of keys[0..m) (31-bit keys), by digits
 * of 11, 10 and 10 bits; *ties (if not NULL) gets how many keys equal to it
 * rank among the s largest. keys[] is reordered (each pass moves the keys
 * that share the digits found so far to the front). */
static uint32_t kth_largest(uint32_t *keys, Py_ssize_t m, Py_ssize_t s, Py_ssize_t *ties)
{
    static const int shifts[] = {20, 10, 0};
    uint32_t prefix = 0;
    for (int p = 0; p < 3; ++p) {
        const int shift = shifts[p];
        Py_ssize_t hist[2048] = {0};
        for (Py_ssize_t i = 0; i < m; ++i)
            ++hist[(keys[i] >> shift) & 0x7FFu];
        uint32_t d = 2047;
        while (hist[d] < s)
            s -= hist[d--];
        prefix |= d << shift;
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < m; ++i) {
            keys[kept] = keys[i];
            kept += ((keys[i] >> shift) & 0x7FFu) == d;
        }
        m = kept;
    }
    if (ties != NULL)
        *ties = s;
    return prefix;
}

/* The bits of residual[i] + x[i] (x[i] when residual is NULL), 0 for a
 * non-finite sum, which *dropped tells. */
static inline uint32_t finite_sum(const float *residual, const float *x, Py_ssize_t i,
                                  int *dropped)
{
    float v = residual != NULL ? residual[i] + x[i] : x[i];
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    *dropped = (u & INF_KEY) == INF_KEY;
    return *dropped ? 0u : u;
}

/* The key of element i of a top-k input: its magnitude bits (`b` = the
 * float32 bits), or, for the fused accumulation, that of residual + x with a
 * non-finite sum as 0 (`b` = x, `r` = residual or NULL). */
typedef uint32_t (*key_fn)(const uint32_t *b, const float *r, Py_ssize_t i);

static uint32_t plain_key(const uint32_t *b, const float *r, Py_ssize_t i)
{
    (void)r;
    return key_of(b, i);
}

static uint32_t accumulated_key(const uint32_t *b, const float *r, Py_ssize_t i)
{
    int dropped;
    return finite_sum(r, (const float *)b, i, &dropped) & 0x7FFFFFFFu;
}

/* A key bound likely below the kk-th largest non-NaN key, from up to
 * SAMPLES keys (one in 64) at evenly spaced positions; 0 when sampling
 * cannot help. */
static uint32_t sampled_bound(key_fn key, const uint32_t *b, const float *r, Py_ssize_t n,
                              Py_ssize_t kk)
{
    const Py_ssize_t samples = n / 64 < SAMPLES ? n / 64 : SAMPLES;
    if (samples < 1024 || kk > n / 8)
        return 0;
    uint32_t *keys = malloc((size_t)samples * sizeof(uint32_t));
    if (keys == NULL)
        return 0;
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < samples; ++j) {
        uint32_t k = key(b, r, (Py_ssize_t)((double)j * (double)n / (double)samples));
        if (k <= INF_KEY)
            keys[m++] = k;
    }
    double expected = (double)samples * (double)kk / (double)n;
    Py_ssize_t rank = (Py_ssize_t)ceil(1.25 * expected + 4.0 * sqrt(expected) + 16.0);
    uint32_t bound = rank <= m ? kth_largest(keys, m, rank, NULL) : 0;
    free(keys);
    return bound;
}

/* The indices i of the keys low <= key(i) <= INF_KEY (NaN never), in
 * ascending order, into out (room for cap: beyond it only counted), with
 * x[i] into values unless NULL; returns how many, and adds the NaN count to
 * *nan (when not NULL). The portable scan looks at every key; the AVX2 one
 * tests 16 keys at a time and walks only the hits. */
static Py_ssize_t scan_portable(const float *x, Py_ssize_t n, uint32_t low, int32_t *out,
                                float *values, Py_ssize_t cap, Py_ssize_t *nan)
{
    const uint32_t *bits = (const uint32_t *)x;
    Py_ssize_t c = 0, nans = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        uint32_t k = key_of(bits, i);
        nans += k > INF_KEY;
        if (k >= low && k <= INF_KEY) {
            if (c < cap) {
                out[c] = (int32_t)i;
                if (values != NULL)
                    values[c] = x[i];
            }
            ++c;
        }
    }
    if (nan != NULL)
        *nan += nans;
    return c;
}

#ifdef SELECT_X86
__attribute__((target("avx2,popcnt")))
static Py_ssize_t scan_avx2(const float *x, Py_ssize_t n, uint32_t low, int32_t *out,
                            float *values, Py_ssize_t cap, Py_ssize_t *nan)
{
    const uint32_t *bits = (const uint32_t *)x;
    /* keys are < 2**31: signed compares order them */
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i below = _mm256_set1_epi32((int32_t)low - 1);
    const __m256i inf = _mm256_set1_epi32((int32_t)INF_KEY);
    Py_ssize_t c = 0, nans = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i k0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(bits + i)), magnitude);
        __m256i k1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(bits + i + 8)),
                                      magnitude);
        __m256i n0 = _mm256_cmpgt_epi32(k0, inf), n1 = _mm256_cmpgt_epi32(k1, inf);
        __m256i h0 = _mm256_andnot_si256(n0, _mm256_cmpgt_epi32(k0, below));
        __m256i h1 = _mm256_andnot_si256(n1, _mm256_cmpgt_epi32(k1, below));
        uint32_t bad = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n0))
                       | (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(n1)) << 8;
        uint32_t hit = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(h0))
                       | (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(h1)) << 8;
        nans += __builtin_popcount(bad);
        for (; hit; hit &= hit - 1) {
            Py_ssize_t j = i + __builtin_ctz(hit);
            if (c < cap) {
                out[c] = (int32_t)j;
                if (values != NULL)
                    values[c] = x[j];
            }
            ++c;
        }
    }
    Py_ssize_t tail_nan = 0;
    Py_ssize_t done = c < cap ? c : cap, room = cap - done;
    Py_ssize_t more = scan_portable(x + i, n - i, low, out + done,
                                    values != NULL ? values + done : NULL, room, &tail_nan);
    for (Py_ssize_t j = 0; j < (more < room ? more : room); ++j)
        out[done + j] += (int32_t)i;
    if (nan != NULL)
        *nan += nans + tail_nan;
    return c + more;
}
#endif

static Py_ssize_t scan(const float *x, Py_ssize_t n, uint32_t low, int32_t *out, float *values,
                       Py_ssize_t cap, Py_ssize_t *nan)
{
#ifdef SELECT_X86
    if (commlib_cast_level(-1) == COMMLIB_CAST_AVX2)
        return scan_avx2(x, n, low, out, values, cap, nan);
#endif
    return scan_portable(x, n, low, out, values, cap, nan);
}

/* The exact bin bound: the lowest key of the histogram bin holding the
 * s-th largest non-NaN key; *above gets the keys from that bound up. */
static int exact_bound(const uint32_t *bits, Py_ssize_t n, Py_ssize_t s, uint32_t *bound,
                       Py_ssize_t *above)
{
    const Py_ssize_t bins = (INF_KEY >> HIST_SHIFT) + 1;
    Py_ssize_t *hist = calloc((size_t)bins, sizeof(Py_ssize_t));
    if (hist == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; ++i) {
        uint32_t k = key_of(bits, i);
        if (k <= INF_KEY)
            ++hist[k >> HIST_SHIFT];
    }
    Py_ssize_t b = bins - 1, total = hist[b];
    while (total < s)
        total += hist[--b];
    free(hist);
    *bound = (uint32_t)b << HIST_SHIFT;
    *above = total;
    return 0;
}

/* The s (1 <= s <= m) largest keys of src among its candidates cand[0..m)
 * (ascending indices), ties to the lowest index, into indices/values in
 * ascending order; returns s, or -1 when out of memory. */
static Py_ssize_t pick(const float *src, const int32_t *cand, Py_ssize_t m, Py_ssize_t s,
                       int32_t *indices, float *values)
{
    const uint32_t *bits = (const uint32_t *)src;
    uint32_t *keys = malloc((size_t)m * sizeof(uint32_t));
    if (keys == NULL)
        return -1;
    for (Py_ssize_t j = 0; j < m; ++j)
        keys[j] = key_of(bits, cand[j]);
    Py_ssize_t ties;
    uint32_t kth = kth_largest(keys, m, s, &ties);
    free(keys);
    Py_ssize_t out = 0;
    for (Py_ssize_t j = 0; j < m && out < s; ++j) {
        uint32_t k = key_of(bits, cand[j]);
        if (k > kth || (k == kth && ties-- > 0)) {
            indices[out] = cand[j];
            values[out++] = src[cand[j]];
        }
    }
    return s;
}

Py_ssize_t commlib_topk(const float *x, float *residual, Py_ssize_t n, Py_ssize_t kk,
                        int32_t *indices, float *values)
{
    const float *src = x;
    if (residual != NULL) {
        for (Py_ssize_t i = 0; i < n; ++i)
            residual[i] = residual[i] + x[i];
        src = residual;
    }
    for (Py_ssize_t i = 0; i < kk; ++i) {
        indices[i] = -1;
        values[i] = 0.0f;
    }
    if (kk == 0 || n == 0)
        return 0;
    const uint32_t *bits = (const uint32_t *)src;
    uint32_t bound = sampled_bound(plain_key, bits, NULL, n, kk);
    Py_ssize_t nan = 0, cap = bound ? 2 * kk + n / 64 + 4096 : n;
    int32_t *cand = malloc((size_t)cap * sizeof(int32_t));
    if (cand == NULL)
        return -1;
    Py_ssize_t m = scan(src, n, bound, cand, NULL, cap, &nan);
    Py_ssize_t s = kk < n - nan ? kk : n - nan;
    if (bound && (m < s || m > cap)) {                 /* the sample misled */
        free(cand);
        Py_ssize_t total;
        if (s == 0 || exact_bound(bits, n, s, &bound, &total))
            return s == 0 ? 0 : -1;
        cand = malloc((size_t)total * sizeof(int32_t));
        if (cand == NULL)
            return -1;
        nan = 0;
        m = scan(src, n, bound, cand, NULL, total, &nan);
    }
    Py_ssize_t picked = s == 0 ? 0 : pick(src, cand, m, s, indices, values);
    free(cand);
    if (residual != NULL && picked > 0)
        for (Py_ssize_t j = 0; j < s; ++j)
            residual[indices[j]] = 0.0f;
    return picked;
}

Py_ssize_t commlib_threshold(const float *x, Py_ssize_t n, uint32_t tkey, int32_t *indices,
                             float *values, Py_ssize_t capacity)
{
    return scan(x, n, tkey + 1, indices, values, capacity, NULL);
}

Py_ssize_t commlib_scatter_add(float *dense, Py_ssize_t n, const int32_t *indices,
                               const float *values, Py_ssize_t m, float alpha)
{
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < m; ++i) {
        int32_t j = indices[i];
        if (j >= 0 && j < n) {
            float p = alpha * values[i];
            dense[j] = dense[j] + p;
        } else {
            bad += j != -1;
        }
    }
    return bad;
}

SELECT_CLONES
Py_ssize_t commlib_accumulate_finite(const float *residual, const float *x, float *acc,
                                     Py_ssize_t n)
{
    Py_ssize_t count = 0;
    uint32_t *a = (uint32_t *)acc;
    for (Py_ssize_t i = 0; i < n; ++i) {
        int dropped;
        a[i] = finite_sum(residual, x, i, &dropped);
        count += dropped;
    }
    return count;
}

Py_ssize_t commlib_sparse_sum(float *dense, Py_ssize_t n, const int32_t *indices,
                              const float *values, Py_ssize_t m, float scale, int scaled)
{
    memset(dense, 0, (size_t)n * sizeof(float));
    Py_ssize_t bad = commlib_scatter_add(dense, n, indices, values, m, 1.0f);
    if (!scaled)
        return bad;
    if (signbit(scale)) {             /* 0 * scale is -0: every entry changes */
        for (Py_ssize_t i = 0; i < n; ++i)
            dense[i] = dense[i] * scale;
        return bad;
    }
    uint8_t *seen = calloc((size_t)n / 8 + 1, 1);
    if (seen == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < m; ++i) {
        int32_t j = indices[i];
        if (j >= 0 && j < n && !(seen[j >> 3] & (1u << (j & 7)))) {
            seen[j >> 3] |= (uint8_t)(1u << (j & 7));
            dense[j] = dense[j] * scale;
        }
    }
    free(seen);
    return bad;
}

/* acc[i] = residual[i] + x[i] (x[i] without a residual), non-finite sums
 * as 0, for i in [from, n), counting those into *bad; indices whose acc key
 * is >= bound go to cand (room for cap) from position c, which is
 * returned advanced by their number. */
static Py_ssize_t accumulate_scan_portable(const float *residual, const float *x, float *acc,
                                           Py_ssize_t from, Py_ssize_t n, uint32_t bound,
                                           int32_t *cand, Py_ssize_t c, Py_ssize_t cap,
                                           Py_ssize_t *bad)
{
    uint32_t *a = (uint32_t *)acc;
    Py_ssize_t nonfinite = 0;
    for (Py_ssize_t i = from; i < n; ++i) {
        int dropped;
        uint32_t u = a[i] = finite_sum(residual, x, i, &dropped);
        nonfinite += dropped;
        if ((u & 0x7FFFFFFFu) >= bound) {          /* bound >= 1: never a dropped 0 */
            if (c < cap)
                cand[c] = (int32_t)i;
            ++c;
        }
    }
    *bad += nonfinite;
    return c;
}

#ifdef SELECT_X86
__attribute__((target("avx2,popcnt")))
static Py_ssize_t accumulate_scan_avx2(const float *residual, const float *x, float *acc,
                                       Py_ssize_t n, uint32_t bound, int32_t *cand,
                                       Py_ssize_t cap, Py_ssize_t *bad)
{
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i inf = _mm256_set1_epi32((int32_t)INF_KEY);
    const __m256i below = _mm256_set1_epi32((int32_t)bound - 1);   /* bound >= 1 */
    Py_ssize_t c = 0, nonfinite = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (residual != NULL)
            v = _mm256_add_ps(_mm256_loadu_ps(residual + i), v);
        __m256i u = _mm256_castps_si256(v);
        __m256i drop = _mm256_cmpeq_epi32(_mm256_and_si256(u, inf), inf);
        u = _mm256_andnot_si256(drop, u);
        _mm256_storeu_si256((__m256i *)(acc + i), u);
        nonfinite += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(drop)));
        __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(u, magnitude), below);
        for (unsigned h = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(hit)); h; h &= h - 1) {
            if (c < cap)
                cand[c] = (int32_t)(i + __builtin_ctz(h));
            ++c;
        }
    }
    *bad += nonfinite;
    return accumulate_scan_portable(residual, x, acc, i, n, bound, cand, c, cap, bad);
}
#endif

/* The accumulate_scan of the code path in use. */
static Py_ssize_t accumulate_scan(const float *residual, const float *x, float *acc,
                                  Py_ssize_t n, uint32_t bound, int32_t *cand, Py_ssize_t cap,
                                  Py_ssize_t *bad)
{
#ifdef SELECT_X86
    if (commlib_cast_level(-1) == COMMLIB_CAST_AVX2)
        return accumulate_scan_avx2(residual, x, acc, n, bound, cand, cap, bad);
#endif
    return accumulate_scan_portable(residual, x, acc, 0, n, bound, cand, 0, cap, bad);
}

Py_ssize_t commlib_topk_accumulate(const float *residual, const float *x, float *acc,
                                   Py_ssize_t n, Py_ssize_t kk, int32_t *indices,
                                   float *values, Py_ssize_t *nonfinite)
{
    *nonfinite = 0;
    uint32_t bound = kk > 0 ? sampled_bound(accumulated_key, (const uint32_t *)x, residual, n,
                                            kk) : 0;
    Py_ssize_t cap = 2 * kk + n / 64 + 4096, m = -1;
    int32_t *cand = bound ? malloc((size_t)cap * sizeof(int32_t)) : NULL;
    if (cand != NULL) {
        m = accumulate_scan(residual, x, acc, n, bound, cand, cap, nonfinite);
        if (m >= kk && m <= cap) {      /* acc holds no NaN: kk entries exist */
            Py_ssize_t picked = pick(acc, cand, m, kk, indices, values);
            free(cand);
            return picked;
        }
        free(cand);
    }
    if (m < 0)                          /* no sampled bound: accumulate first */
        *nonfinite = commlib_accumulate_finite(residual, x, acc, n);
    return commlib_topk(acc, NULL, n, kk, indices, values);
}

Py_ssize_t commlib_threshold_accumulate(const float *residual, const float *x, float *acc,
                                        Py_ssize_t n, uint32_t tkey, int32_t *indices,
                                        float *values, Py_ssize_t capacity,
                                        Py_ssize_t *nonfinite)
{
    *nonfinite = 0;
    Py_ssize_t c = accumulate_scan(residual, x, acc, n, tkey + 1, indices, capacity, nonfinite);
    for (Py_ssize_t j = 0; j < (c < capacity ? c : capacity); ++j)
        values[j] = acc[indices[j]];
    return c;
}
