/* One block of a host cast (hostcast.c), included once per instruction set:
 * before including, define BLOCK_NAME(s) (the functions' names with suffix
 * s), BLOCK_ATTR (their target attribute, or nothing) and, for F16C
 * conversions, BLOCK_F16C.
 *
 * BLOCK_NAME(_run)(src, sfmt, dst, dfmt, n, scale, scaled, op) computes,
 * for each of the n <= CAST_BLOCK elements, in IEEE float32 and in this order:
 *     v = widen(src[i]); if scaled: v = scale * v;
 *     if op != CAST_OP_NONE: v = op(widen(dst[i]), v);
 *     dst[i] = narrow(v)   (round to nearest even, overflow -> inf,
 *                           canonical NaN)
 * and returns how many non-finite values it wrote. src and dst may be the
 * same memory (same format); no other overlap. No FMA (-ffp-contract=off). */

static BLOCK_ATTR void BLOCK_NAME(_widen)(const void *src, int fmt, float *v, Py_ssize_t n)
{
    if (fmt == CAST_F32) {
        memcpy(v, src, (size_t)n * sizeof(float));
    } else if (fmt == CAST_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        uint32_t *u = (uint32_t *)v;
        for (Py_ssize_t i = 0; i < n; ++i)
            u[i] = (uint32_t)s[i] << 16;
    } else {
        const uint16_t *s = (const uint16_t *)src;
        Py_ssize_t i = 0;
#ifdef BLOCK_F16C
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(v + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; ++i)
            v[i] = f16_to_f32(s[i]);
    }
}

static BLOCK_ATTR Py_ssize_t BLOCK_NAME(_narrow)(const float *v, void *dst, int fmt, Py_ssize_t n)
{
    const uint32_t *u = (const uint32_t *)v;
    Py_ssize_t count = 0;
    if (fmt == CAST_F32) {
        uint32_t *d = (uint32_t *)dst;
        for (Py_ssize_t i = 0; i < n; ++i) {
            uint32_t mag = u[i] & 0x7FFFFFFFu;
            count += mag >= 0x7F800000u;
            d[i] = mag > 0x7F800000u ? 0x7FC00000u : u[i];
        }
    } else if (fmt == CAST_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (Py_ssize_t i = 0; i < n; ++i) {
            uint32_t mag = u[i] & 0x7FFFFFFFu;
            uint32_t r = (u[i] + 0x7FFFu + ((u[i] >> 16) & 1u)) >> 16;
            count += mag >= BF16_OVERFLOW;
            d[i] = mag > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)r;
        }
    } else {
        uint16_t *d = (uint16_t *)dst;
        Py_ssize_t i = 0;
#ifdef BLOCK_F16C
        /* eight at a time: convert, then count inf and NaN and make NaN
         * canonical on the eight halves in a vector register */
        const __m128i exponent = _mm_set1_epi16(0x7C00), magnitude = _mm_set1_epi16(0x7FFF);
        const __m128i canonical = _mm_set1_epi16(0x7E00);
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(v + i),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m128i special = _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent);
            /* NaN: magnitude above inf's (signed compare is right below 0x8000) */
            __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, magnitude), exponent);
            count += __builtin_popcount((unsigned)_mm_movemask_epi8(special)) / 2;
            _mm_storeu_si128((__m128i *)(d + i), _mm_blendv_epi8(h, canonical, nan));
        }
#endif
        for (Py_ssize_t j = i; j < n; ++j)
            d[j] = f32_to_f16(u[j]);
        for (; i < n; ++i) {               /* canonical NaN; count inf and NaN */
            count += (d[i] & 0x7C00u) == 0x7C00u;
            d[i] = (d[i] & 0x7FFFu) > 0x7C00u ? (uint16_t)0x7E00u : d[i];
        }
    }
    return count;
}

#ifdef BLOCK_F16C
/* Eight elements to a register: the helpers of the commonest casts and of
 * the half-precision share's sum (_fast and _sum_own below). */

static BLOCK_ATTR inline __attribute__((always_inline)) __m256 BLOCK_NAME(_widen8r)(__m128i h, int fmt)
{
    if (fmt == CAST_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static BLOCK_ATTR inline __attribute__((always_inline)) __m256 BLOCK_NAME(_widen8)(const uint16_t *s, int fmt)
{
    return BLOCK_NAME(_widen8r)(_mm_loadu_si128((const __m128i *)s), fmt);
}

/* float32 to the half format ``fmt``, rounded to nearest even (bfloat16:
 * on the bits), NaN canonical; the lanes that are inf or NaN OR-ed into
 * *special, which a caller counts (_specials) only at the end: the low
 * 128 bits' 16-bit lanes for float16 (the high bits are not defined then),
 * the 32-bit lanes for bfloat16 */
static BLOCK_ATTR inline __attribute__((always_inline)) __m128i BLOCK_NAME(_narrow8m)(__m256 x, int fmt, __m256i *special)
{
    if (fmt == CAST_F16) {
        const __m128i exponent = _mm_set1_epi16(0x7C00), magnitude = _mm_set1_epi16(0x7FFF);
        __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        *special = _mm256_or_si256(*special, _mm256_castsi128_si256(
            _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent)));
        __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, magnitude), exponent);
        return _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
    }
    const __m256i u = _mm256_castps_si256(x);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i r = _mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF));
    r = _mm256_add_epi32(r, _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    r = _mm256_srli_epi32(r, 16);
    __m256i big = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32((int)(BF16_OVERFLOW - 1u)));
    *special = _mm256_or_si256(*special, big);
    __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(r);
}

/* How many lanes of ``special``, OR-ed by _narrow8m for the format ``fmt``
 * (or 32-bit lanes for float32), were inf or NaN. */
static BLOCK_ATTR inline __attribute__((always_inline)) int BLOCK_NAME(_specials)(
    __m256i special, int fmt)
{
    if (fmt == CAST_F16)
        return __builtin_popcount((unsigned)_mm_movemask_epi8(_mm256_castsi256_si128(special)))
               / 2;
    return __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(special)));
}

/* One of the commonest casts (the formats constant once inlined, see
 * _fast; they alone say which cast: float32 to a half format, back, or a
 * sum in a half format): inf and NaN are noted with a mask and counted
 * afterwards, in the output, only when one went by. */
static BLOCK_ATTR inline __attribute__((always_inline)) Py_ssize_t BLOCK_NAME(_fast_in)(
    const void *src, const int sfmt, void *dst, const int dfmt, Py_ssize_t n, float scale,
    int scaled, int streaming, Py_ssize_t *count)
{
    const __m256 factor = _mm256_set1_ps(scale);
    __m256i special = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    if (sfmt == CAST_F32) {                   /* float32 to a half format */
        const float *s = (const float *)src;
        uint16_t *d = (uint16_t *)dst;
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_loadu_ps(s + i);
            if (scaled)
                x = _mm256_mul_ps(factor, x);
            __m128i h = BLOCK_NAME(_narrow8m)(x, dfmt, &special);
            if (streaming)                   /* d + i is 16-byte aligned (commlib_cast) */
                _mm_stream_si128((__m128i *)(d + i), h);
            else
                _mm_storeu_si128((__m128i *)(d + i), h);
        }
    } else if (dfmt == CAST_F32) {            /* a half format to float32 */
        const uint16_t *s = (const uint16_t *)src;
        float *d = (float *)dst;
        const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
        const __m256i finite_max = _mm256_set1_epi32(0x7F7FFFFF);
        const __m256i inf = _mm256_set1_epi32(0x7F800000);
        const __m256i canonical = _mm256_set1_epi32(0x7FC00000);
        for (; i + 8 <= n; i += 8) {
            __m256 x = BLOCK_NAME(_widen8)(s + i, sfmt);
            if (scaled)
                x = _mm256_mul_ps(factor, x);
            __m256i mag = _mm256_and_si256(_mm256_castps_si256(x), magnitude);
            special = _mm256_or_si256(special, _mm256_cmpgt_epi32(mag, finite_max));
            __m256i nan = _mm256_cmpgt_epi32(mag, inf);
            _mm256_storeu_ps(d + i, _mm256_blendv_ps(x, _mm256_castsi256_ps(canonical),
                                                     _mm256_castsi256_ps(nan)));
        }
    } else {                                  /* sums in a half format */
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (; i + 8 <= n; i += 8) {
            __m256 x = BLOCK_NAME(_widen8)(s + i, sfmt);
            if (scaled)
                x = _mm256_mul_ps(factor, x);
            __m256 y = BLOCK_NAME(_widen8)(d + i, dfmt);
            _mm_storeu_si128((__m128i *)(d + i),
                             BLOCK_NAME(_narrow8m)(_mm256_add_ps(y, x), dfmt, &special));
        }
    }
    if (BLOCK_NAME(_specials)(special, dfmt)) {
        if (streaming)
            _mm_sfence();
        *count += commlib_count_nonfinite(dst, dfmt, i);
    }
    return i;
}

/* The commonest casts in one pass, eight elements to a register, each the
 * same bits as the general path below (widen, scale, op, narrow): float32
 * to a half format (the wire of a compressed bucket), a half format to
 * float32 (its result back into the arrays) and sums in a half format (the
 * reduction). Returns how many elements it did (a multiple of eight; 0
 * when the cast is not one of these), their inf and NaN added to *count. */
static BLOCK_ATTR Py_ssize_t BLOCK_NAME(_fast)(const void *src, int sfmt, void *dst, int dfmt,
                                              Py_ssize_t n, float scale, int scaled, int op,
                                              int streaming, Py_ssize_t *count)
{
#define FAST(S, D) BLOCK_NAME(_fast_in)(src, S, dst, D, n, scale, scaled, streaming, count)
    if (op == CAST_OP_NONE && sfmt == CAST_F32 && dfmt != CAST_F32)
        return dfmt == CAST_F16 ? FAST(CAST_F32, CAST_F16)
                                : FAST(CAST_F32, CAST_BF16);
    if (op == CAST_OP_NONE && sfmt != CAST_F32 && dfmt == CAST_F32)
        return sfmt == CAST_F16 ? FAST(CAST_F16, CAST_F32)
                                : FAST(CAST_BF16, CAST_F32);
    if (op == CAST_OP_SUM && sfmt != CAST_F32 && dfmt == sfmt)
        return sfmt == CAST_F16 ? FAST(CAST_F16, CAST_F16)
                                : FAST(CAST_BF16, CAST_BF16);
#undef FAST
    return 0;
}

/* The rank-order sum of a half-format share, this rank's contribution
 * rounded from float32 on the way (hostreduce.c's cast_own, op sum): for
 * the first i elements (a multiple of eight, returned), out[j] =
 * narrow(...narrow(x0[j] + x1[j]) + ... + x(n-1)[j]), each sum in float32,
 * where x_rank = narrow(scale * own[j]) and x_q = slots[q][at + j]
 * otherwise; the inf and NaN of x_rank added to *sent, those of out to
 * *found. The same bits as a cast into a slot, then commlib_cast's sums.
 * The loop only notes whether any inf or NaN went by; they are counted
 * afterwards, in a pass of their own, when one did (rarely). */
static BLOCK_ATTR inline __attribute__((always_inline)) Py_ssize_t BLOCK_NAME(_sum_own_in)(
    const float *own, float scale, int scaled, char *const *slots, int nranks, int rank,
    Py_ssize_t at, uint16_t *out, const int fmt, Py_ssize_t n, Py_ssize_t *sent,
    Py_ssize_t *found)
{
    const __m256 factor = _mm256_set1_ps(scale);
    __m256i mine_special = _mm256_setzero_si256(), out_special = _mm256_setzero_si256();
    __m256i ignored = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    if (nranks == 2) {
        /* one sum: x + y and y + x are the same bits (NaNs are canonical) */
        const uint16_t *other = (const uint16_t *)slots[1 - rank] + at;
        for (; i + 8 <= n; i += 8) {
            __m256 x = _mm256_loadu_ps(own + i);
            if (scaled)
                x = _mm256_mul_ps(factor, x);
            __m256 mine = BLOCK_NAME(_widen8r)(BLOCK_NAME(_narrow8m)(x, fmt, &mine_special),
                                               fmt);
            __m256 sum = _mm256_add_ps(mine, BLOCK_NAME(_widen8)(other + i, fmt));
            _mm_storeu_si128((__m128i *)(out + i), BLOCK_NAME(_narrow8m)(sum, fmt, &out_special));
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(own + i);
        if (scaled)
            x = _mm256_mul_ps(factor, x);
        __m256 mine = BLOCK_NAME(_widen8r)(BLOCK_NAME(_narrow8m)(x, fmt, &mine_special), fmt);
        __m256 acc = rank == 0 ? mine
                               : BLOCK_NAME(_widen8)((const uint16_t *)slots[0] + at + i, fmt);
        for (int q = 1; q < nranks; ++q) {
            __m256 sum = _mm256_add_ps(acc, q == rank ? mine : BLOCK_NAME(_widen8)(
                (const uint16_t *)slots[q] + at + i, fmt));
            if (q == nranks - 1)
                _mm_storeu_si128((__m128i *)(out + i),
                                 BLOCK_NAME(_narrow8m)(sum, fmt, &out_special));
            else
                acc = BLOCK_NAME(_widen8r)(BLOCK_NAME(_narrow8m)(sum, fmt, &ignored), fmt);
        }
    }
    if (BLOCK_NAME(_specials)(mine_special, fmt)) {
        Py_ssize_t count = 0;
        for (Py_ssize_t j = 0; j < i; j += 8) {
            __m256 x = _mm256_loadu_ps(own + j);
            __m256i special = _mm256_setzero_si256();
            (void)BLOCK_NAME(_narrow8m)(scaled ? _mm256_mul_ps(factor, x) : x, fmt, &special);
            count += BLOCK_NAME(_specials)(special, fmt);
        }
        *sent += count;
    }
    if (BLOCK_NAME(_specials)(out_special, fmt))
        *found += commlib_count_nonfinite(out, fmt, i);
    return i;
}
/* (the loop compiled once per format, so that no test of the format is
 * left in it) */
static BLOCK_ATTR Py_ssize_t BLOCK_NAME(_sum_own)(const float *own, float scale, int scaled,
                                                 char *const *slots, int nranks, int rank,
                                                 Py_ssize_t at, uint16_t *out, int fmt,
                                                 Py_ssize_t n, Py_ssize_t *sent,
                                                 Py_ssize_t *found)
{
    if (fmt == CAST_F16)
        return BLOCK_NAME(_sum_own_in)(own, scale, scaled, slots, nranks, rank, at, out,
                                       CAST_F16, n, sent, found);
    return BLOCK_NAME(_sum_own_in)(own, scale, scaled, slots, nranks, rank, at, out, CAST_BF16,
                                   n, sent, found);
}
#endif

static BLOCK_ATTR Py_ssize_t BLOCK_NAME(_run)(const void *src, int sfmt, void *dst, int dfmt,
                                             Py_ssize_t n, float scale, int scaled, int op,
                                             int streaming)
{
    float v[CAST_BLOCK], w[CAST_BLOCK];
#ifdef BLOCK_F16C
    Py_ssize_t count = 0, done = BLOCK_NAME(_fast)(src, sfmt, dst, dfmt, n, scale, scaled, op,
                                                   streaming, &count);
    if (done > 0) {                       /* the rest (under eight) as below */
        static const size_t bytes[] = {4, 2, 2};
        return count + BLOCK_NAME(_run)((const char *)src + (size_t)done * bytes[sfmt], sfmt,
                                        (char *)dst + (size_t)done * bytes[dfmt], dfmt,
                                        n - done, scale, scaled, op, 0);
    }
#else
    (void)streaming;
#endif
    BLOCK_NAME(_widen)(src, sfmt, v, n);
    if (scaled)
        for (Py_ssize_t i = 0; i < n; ++i)
            v[i] = scale * v[i];
    if (op != CAST_OP_NONE) {
        BLOCK_NAME(_widen)(dst, dfmt, w, n);
        /* max/min as numpy's float32 maximum/minimum: NaN wins, ties give
         * the second operand */
        switch (op) {
        case CAST_OP_SUM:
            for (Py_ssize_t i = 0; i < n; ++i)
                v[i] = w[i] + v[i];
            break;
        case CAST_OP_PROD:
            for (Py_ssize_t i = 0; i < n; ++i)
                v[i] = w[i] * v[i];
            break;
        case CAST_OP_MAX:
            for (Py_ssize_t i = 0; i < n; ++i)
                v[i] = w[i] != w[i] ? w[i] : (w[i] > v[i] ? w[i] : v[i]);
            break;
        default:
            for (Py_ssize_t i = 0; i < n; ++i)
                v[i] = w[i] != w[i] ? w[i] : (w[i] < v[i] ? w[i] : v[i]);
            break;
        }
    }
    return BLOCK_NAME(_narrow)(v, dst, dfmt, n);
}
