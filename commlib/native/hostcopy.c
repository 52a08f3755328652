/* Batched host copies between many numpy arrays and one flat buffer
 * (commlib/ops/hostcopy.py). */
#include <string.h>

#include "native.h"
#include "streaming.h"

/* Copy the part of bytes [at, at + bytes) of the concatenation that lies in
 * [begin, end), between `data` (which holds those bytes) and `flat`;
 * streaming stores into `flat` when `streaming`. */
static void copy_window(char *data, char *flat, Py_ssize_t at, Py_ssize_t bytes,
                        Py_ssize_t begin, Py_ssize_t end, int to_arrays, int streaming)
{
    if (begin < at)
        begin = at;
    if (end > at + bytes)
        end = at + bytes;
    if (begin >= end)
        return;
    if (to_arrays)
        memcpy(data + (begin - at), flat + begin, (size_t)(end - begin));
    else
        copy_out(flat + begin, data + (begin - at), (size_t)(end - begin), streaming);
}

/* Copy between every array of `spans` (`n` of them, `total` bytes together)
 * and the flat buffer `flat`, back to back: into the
 * buffer when `to_arrays` is 0 (gather), out of it into the arrays
 * otherwise (scatter). Bytes [skip_begin, skip_end) of the concatenation are
 * left out. `streaming`: gather with streaming stores (streaming.h). */
void commlib_copy(const commlib_span *spans, Py_ssize_t n, char *flat, int to_arrays,
                  Py_ssize_t skip_begin, Py_ssize_t skip_end, Py_ssize_t total, int streaming)
{
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        Py_ssize_t bytes = spans[i].bytes;
        char *data = spans[i].data;
        copy_window(data, flat, at, bytes, 0, skip_begin, to_arrays, streaming);
        copy_window(data, flat, at, bytes, skip_end, total, to_arrays, streaming);
        at += bytes;
    }
    streaming_fence(streaming && !to_arrays);
}
