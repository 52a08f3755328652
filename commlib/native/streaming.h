/* Copies into shared memory that another core is about to read.
 *
 * A plain store to a cache line that another core holds (it read the line
 * in the previous round) first has to take the line away from that core.
 * Where the two cores sit far apart (another core complex or socket) that
 * costs several times the copy itself; streaming (non-temporal) stores
 * write whole lines to memory without fetching them. They are slower when
 * the cores are close, so the caller chooses (see transport/shm.py).
 */
#ifndef COMMLIB_STREAMING_H
#define COMMLIB_STREAMING_H

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define COMMLIB_HAVE_STREAMING 1
#else
#define COMMLIB_HAVE_STREAMING 0
#endif

/* memcpy(dst, src, n), with streaming stores for the 64-byte aligned body
 * of dst when `streaming` (and the CPU has them). Ends with a store fence,
 * so the data is visible before any later flag store. */
static inline void copy_out(char *dst, const char *src, size_t n, int streaming)
{
#if COMMLIB_HAVE_STREAMING
    if (streaming && n >= 256) {
        size_t head = (size_t)(-(uintptr_t)dst & 63);
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; dst += 64, src += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
        return;
    }
#else
    (void)streaming;
#endif
    memcpy(dst, src, n);
}

/* Orders streaming stores before the stores that follow (the sync flag). */
static inline void streaming_fence(int streaming)
{
#if COMMLIB_HAVE_STREAMING
    if (streaming)
        _mm_sfence();
#else
    (void)streaming;
#endif
}

#endif
