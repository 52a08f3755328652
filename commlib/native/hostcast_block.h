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

static BLOCK_ATTR Py_ssize_t BLOCK_NAME(_run)(const void *src, int sfmt, void *dst, int dfmt,
                                             Py_ssize_t n, float scale, int scaled, int op)
{
    float v[CAST_BLOCK], w[CAST_BLOCK];
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
