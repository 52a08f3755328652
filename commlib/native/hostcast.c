/* Host casts between float32, float16 and bfloat16 with a scale and an
 * optional reduction into the destination (commlib/ops/hostcast.py): the
 * compiled twin of commlib/ops/cast.py's numpy_cast_into, bit for bit, and
 * the float16/bfloat16 reduction of the MPI transport's user operators.
 *
 * Work goes in blocks of CAST_BLOCK elements through a float32 buffer on
 * the stack (hostcast_block.h). On x86-64 CPUs with AVX2 and F16C the
 * blocks run in code compiled for them (F16C conversions for float16, the
 * rest vectorised by the compiler), chosen at run time
 * (__builtin_cpu_supports); elsewhere in portable C. Both give the same
 * bits: float16 conversions round to nearest even in both (the portable one
 * is kernels/common.cuh's cl_f32_to_f16 / cl_f16_to_f32). */
#include <stdint.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CAST_X86 1
#endif

#define CAST_BLOCK 512
#define BF16_OVERFLOW 0x7F7F8000u   /* |bits| from here round to bfloat16 inf */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 bits -> float16 bits, round to nearest even, overflow -> inf
 * (NaN: some NaN; the caller makes it canonical). */
static inline uint16_t f32_to_f16(uint32_t u)
{
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u)
        return 0x7E00u;
    if (a >= 0x477FF000u)                                /* >= 65520: inf */
        return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) {                              /* normal half */
        a -= 0x38000000u;
        return (uint16_t)(sign | ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u)                                /* <= 2^-25: zero */
        return (uint16_t)sign;
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;      /* subnormal half */
    const uint32_t shift = 126u - (a >> 23);             /* 14 .. 24 */
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        ++r;
    return (uint16_t)(sign | r);
}

/* float16 bits -> float32, exact. */
static inline float f16_to_f32(uint16_t h)
{
    const uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = ((uint32_t)h >> 10) & 0x1Fu, m = (uint32_t)h & 0x3FFu;
    if (e == 0x1Fu)
        return bits_f32(sign | 0x7F800000u | (m << 13));
    if (e == 0u) {
        if (m == 0u)
            return bits_f32(sign);
        e = 1u;
        while (!(m & 0x400u)) {
            m <<= 1;
            --e;
        }
        m &= 0x3FFu;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

#define CAST_CAT2(a, b) a##b
#define CAST_CAT(a, b) CAST_CAT2(a, b)

#define BLOCK_NAME(s) CAST_CAT(portable_block, s)
#define BLOCK_ATTR
#include "hostcast_block.h"
#undef BLOCK_NAME
#undef BLOCK_ATTR

#ifdef CAST_X86
#define BLOCK_NAME(s) CAST_CAT(avx2_block, s)
#define BLOCK_ATTR __attribute__((target("avx2,f16c")))
#define BLOCK_F16C 1
#include "hostcast_block.h"
#undef BLOCK_NAME
#undef BLOCK_ATTR
#undef BLOCK_F16C
#endif

typedef Py_ssize_t (*block_fn)(const void *, int, void *, int, Py_ssize_t, float, int, int,
                               int);

static int simd_level = -1;     /* -1: not chosen yet */

static int best_level(void)
{
#ifdef CAST_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return COMMLIB_CAST_AVX2;
#endif
    return COMMLIB_CAST_PORTABLE;
}

int commlib_cast_level(int level)
{
    int best = best_level();
    if (level >= 0)
        simd_level = level < best ? level : best;
    else if (simd_level < 0)
        simd_level = best;
    return simd_level;
}

Py_ssize_t commlib_half_sum_own(const float *own, float scale, int scaled, char *const *slots,
                                int nranks, int rank, Py_ssize_t at, uint16_t *out, int fmt,
                                Py_ssize_t n, Py_ssize_t *sent, Py_ssize_t *found)
{
#ifdef CAST_X86
    if (commlib_cast_level(-1) == COMMLIB_CAST_AVX2 && nranks >= 2)
        return avx2_block_sum_own(own, scale, scaled, slots, nranks, rank, at, out, fmt, n,
                                  sent, found);
#endif
    (void)own; (void)scale; (void)scaled; (void)slots; (void)nranks; (void)rank; (void)at;
    (void)out; (void)fmt; (void)n; (void)sent; (void)found;
    return 0;
}

static const size_t item_size[] = {4, 2, 2};   /* by format: f32, f16, bf16 */

Py_ssize_t commlib_cast(const void *src, int sfmt, void *dst, int dfmt, Py_ssize_t n,
                        float scale, int scaled, int op, int streaming)
{
    block_fn block = portable_block_run;
#ifdef CAST_X86
    if (commlib_cast_level(-1) == COMMLIB_CAST_AVX2)
        block = avx2_block_run;
    else
        streaming = 0;
#else
    streaming = 0;
#endif
    const char *s = (const char *)src;
    char *d = (char *)dst;
    Py_ssize_t count = 0, at = 0;
    if (streaming) {
        /* the elements before dst's first 16-byte boundary with plain stores
         * (non-temporal vector stores need it aligned), the rest streamed */
        Py_ssize_t head = (Py_ssize_t)((16u - ((uintptr_t)d & 15u)) & 15u) / (Py_ssize_t)item_size[dfmt];
        if ((uintptr_t)d % item_size[dfmt] != 0 || head > n)
            head = n;
        count += block(s, sfmt, d, dfmt, head, scale, scaled, op, 0);
        at = head;
    }
    for (; at < n; at += CAST_BLOCK) {
        Py_ssize_t m = n - at < CAST_BLOCK ? n - at : CAST_BLOCK;
        count += block(s + (size_t)at * item_size[sfmt], sfmt, d + (size_t)at * item_size[dfmt],
                       dfmt, m, scale, scaled, op, streaming);
    }
#ifdef CAST_X86
    if (streaming)
        _mm_sfence();
#endif
    return count;
}

Py_ssize_t commlib_count_nonfinite(const void *data, int fmt, Py_ssize_t n)
{
    Py_ssize_t count = 0;
    if (fmt == CAST_F32) {
        const uint32_t *u = (const uint32_t *)data;
        for (Py_ssize_t i = 0; i < n; ++i)
            count += (u[i] & 0x7F800000u) == 0x7F800000u;
        return count;
    }
    const uint16_t exponent = fmt == CAST_F16 ? 0x7C00u : 0x7F80u;
    const uint16_t *h = (const uint16_t *)data;
    for (Py_ssize_t lo = 0; lo < n; lo += 1 << 15) {   /* 16-bit counters per piece */
        Py_ssize_t hi = n - lo < (1 << 15) ? n : lo + (1 << 15);
        uint16_t piece = 0;
        for (Py_ssize_t i = lo; i < hi; ++i)
            piece += (h[i] & exponent) == exponent;
        count += piece;
    }
    return count;
}
