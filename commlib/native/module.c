/* The extension module `commlib._hostloops`: argument checks in front of the
 * host loops (hostcopy.c, hostreduce.c, flag_wait.c, hostcast.c, hostselect.c),
 * called from commlib/ops/hostcopy.py, commlib/ops/hostreduce.py,
 * commlib/ops/hostcast.py, commlib/ops/hostselect.py, commlib/collective/bucketing.py,
 * commlib/transport/shm.py and commlib/faults/board.py. Built by the package build
 * (setup.py), loaded by commlib/ops/_native.py.
 *
 * Every check runs before any memory is touched; a check that fails
 * returns -1 (the caller takes its numpy path or raises) and nothing is
 * written. */
#include <time.h>

#define COMMLIB_IMPORTS_NUMPY
#include "native.h"

static PyObject *array_type_error;   /* commlib.errors.ArrayTypeError, from init() */

#define MAX_STACK_RANKS 64

/* Bytes of `o` when it is a plain array (arrays.h) of dtype object
 * `descr`; else -1. */
static Py_ssize_t buffer_bytes(PyObject *o, PyArray_Descr *descr, Py_ssize_t itemsize,
                               int writing)
{
    if (!plain_array(o, writing) || PyArray_DESCR((PyArrayObject *)o) != descr)
        return -1;
    return array_bytes(o, itemsize);
}

/* Whether `o` is a tuple or list; then *items are its items (which may be
 * NULL when it is empty) and *n their number. */
static int sequence_items(PyObject *o, PyObject ***items, Py_ssize_t *n)
{
    if (!PyTuple_Check(o) && !PyList_Check(o))
        return 0;
    *n = PySequence_Fast_GET_SIZE(o);
    *items = PySequence_Fast_ITEMS(o);
    return 1;
}

/* The dtype object of the first array of `arrays` (a tuple or list of at
 * least one exact ndarray), or NULL. */
static PyArray_Descr *first_descr(PyObject *arrays)
{
    Py_ssize_t n = 0;
    PyObject **items;
    if (!sequence_items(arrays, &items, &n) || n < 1 || !PyArray_CheckExact(items[0]))
        return NULL;
    return PyArray_DESCR((PyArrayObject *)items[0]);
}

/* Whether every item of `arrays` (a tuple or list) is an exact ndarray,
 * aligned and in native byte order. */
static int aligned_native(PyObject *arrays)
{
    Py_ssize_t n;
    PyObject **items;
    if (!sequence_items(arrays, &items, &n))
        return 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyArray_CheckExact(items[i]))
            return 0;
        PyArrayObject *a = (PyArrayObject *)items[i];
        if (!PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a))
            return 0;
    }
    return 1;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
    return -1;
}

/* init(ArrayTypeError): the error class raised for unusable flat buffers. */
static PyObject *py_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("init", nargs, 1))
        return NULL;
    Py_INCREF(args[0]);
    Py_XDECREF(array_type_error);
    array_type_error = args[0];
    Py_RETURN_NONE;
}

/* copy(arrays, flat, itemsize, to_arrays, skip_begin, skip_end, streaming)
 * -> bytes of the arrays together, or -1 (nothing copied) when they do not
 * qualify (see checked_total) or do not fit. Raises ArrayTypeError when
 * `flat` is not a C-contiguous numpy array (writeable, for a gather).
 * Skip bounds are in bytes. */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("copy", nargs, 7))
        return NULL;
    PyObject *arrays = args[0], *flat = args[1];
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[2]);
    int to_arrays = PyObject_IsTrue(args[3]);
    Py_ssize_t skip_begin = PyLong_AsSsize_t(args[4]), skip_end = PyLong_AsSsize_t(args[5]);
    int streaming = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (!plain_array(flat, 0))
        return PyErr_Format(array_type_error,
                            "commlib: the flat buffer must be a C-contiguous numpy array");
    if (!to_arrays && !plain_array(flat, 1))
        return PyErr_Format(array_type_error, "commlib: the flat buffer is read-only");
    if ((PyTuple_Check(arrays) || PyList_Check(arrays)) && PySequence_Fast_GET_SIZE(arrays) == 0)
        return PyLong_FromLong(0);
    PyArray_Descr *descr = first_descr(arrays);
    if (descr == NULL || itemsize <= 0)
        return PyLong_FromLong(-1);
    Py_ssize_t capacity = buffer_bytes(flat, descr, itemsize, !to_arrays);
    Py_ssize_t total = checked_total(arrays, descr, itemsize, capacity, to_arrays);
    if (capacity < 0 || total < 0)
        return PyLong_FromLong(-1);
    commlib_span stack[COMMLIB_STACK_SPANS];
    Py_ssize_t n;
    commlib_span *spans = spans_of(arrays, itemsize, stack, COMMLIB_STACK_SPANS, &n);
    if (spans == NULL)
        return NULL;
    char *data = array_data(flat);
    Py_BEGIN_ALLOW_THREADS
    commlib_copy(spans, n, data, to_arrays, skip_begin, skip_end, total, streaming);
    Py_END_ALLOW_THREADS
    if (spans != stack)
        PyMem_Free(spans);
    return PyLong_FromSsize_t(total);
}

/* reduce_share(parts, slots, rank, result, itemsize, type, op, begin, end,
 * scale, streaming, cast_own) -> end - begin, or -1 (nothing written) when
 * an argument does not qualify. `slots`: tuple of every rank's flat buffer;
 * `scale`: float or None; bounds in bytes of the element type. `cast_own`:
 * None, or the float scale by which float32 `parts` are rounded to the half
 * format `type` (aligned arrays, not written); then the result is the pair
 * (NaN and inf the rounding gave, NaN and inf in the result). See
 * hostreduce.c. */
static PyObject *py_reduce_share(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("reduce_share", nargs, 12))
        return NULL;
    PyObject *parts = args[0], *slots = args[1], *result = args[3];
    long rank = PyLong_AsLong(args[2]);
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[4]);
    long type = PyLong_AsLong(args[5]), op = PyLong_AsLong(args[6]);
    Py_ssize_t begin = PyLong_AsSsize_t(args[7]), end = PyLong_AsSsize_t(args[8]);
    int scaled = args[9] != Py_None;
    double scale = scaled ? PyFloat_AsDouble(args[9]) : 0.0;
    int streaming = PyObject_IsTrue(args[10]);
    int cast_own = args[11] != Py_None;
    double own_scale = cast_own ? PyFloat_AsDouble(args[11]) : 1.0;
    if (PyErr_Occurred())
        return NULL;
    /* the element size of each type code (native.h) */
    static const Py_ssize_t type_size[COMMLIB_T_COUNT] = {4, 8, 4, 8, 1, 2, 2};
    PyArray_Descr *descr = PyArray_CheckExact(result) ? PyArray_DESCR((PyArrayObject *)result)
                                                      : NULL;
    PyArray_Descr *own = first_descr(parts);
    Py_ssize_t own_size = cast_own ? 4 : itemsize;
    if (descr == NULL || own == NULL || (cast_own ? own->type_num != NPY_FLOAT32 : own != descr)
            || !PyTuple_Check(slots) || type < 0
            || type >= COMMLIB_T_COUNT || op < 0 || op >= COMMLIB_OP_COUNT
            || itemsize != type_size[type] || begin < 0 || begin > end || begin % itemsize
            || end % itemsize
            || (cast_own && type != COMMLIB_T_FLOAT16 && type != COMMLIB_T_BFLOAT16)
            || (cast_own && !aligned_native(parts)))
        return PyLong_FromLong(-1);
    Py_ssize_t nranks = PyTuple_GET_SIZE(slots);
    if (nranks < 2 || nranks > 1 << 20 || rank < 0 || rank >= nranks
            || buffer_bytes(result, descr, itemsize, 1) < end
            || checked_total(parts, own, own_size, PY_SSIZE_T_MAX, !cast_own)
               < end / itemsize * own_size)
        return PyLong_FromLong(-1);
    char *stack[MAX_STACK_RANKS];
    char **pointers = nranks <= MAX_STACK_RANKS ? stack : PyMem_Malloc(nranks * sizeof(char *));
    if (pointers == NULL)
        return PyErr_NoMemory();
    int ok = 1;
    for (Py_ssize_t q = 0; q < nranks; ++q) {
        PyObject *slot = PyTuple_GET_ITEM(slots, q);
        ok &= q == rank || buffer_bytes(slot, descr, itemsize, 0) >= end;
        pointers[q] = PyArray_CheckExact(slot) ? array_data(slot) : NULL;
    }
    commlib_span span_stack[COMMLIB_STACK_SPANS], *spans = span_stack;
    Py_ssize_t n = 0, sent = 0, found = 0;
    if (ok)
        spans = spans_of(parts, own_size, span_stack, COMMLIB_STACK_SPANS, &n);
    if (ok && spans != NULL) {
        char *out = array_data(result);
        Py_BEGIN_ALLOW_THREADS
        sent = commlib_reduce_share(spans, n, itemsize, (int)type, (int)op, pointers,
                                    (int)nranks, (int)rank, out, begin, end, scale, scaled,
                                    streaming, cast_own, (float)own_scale, &found);
        Py_END_ALLOW_THREADS
    }
    if (spans != span_stack && spans != NULL)
        PyMem_Free(spans);
    if (pointers != stack)
        PyMem_Free(pointers);
    if (spans == NULL)
        return NULL;
    if (!ok)
        return PyLong_FromLong(-1);
    if (cast_own)
        return Py_BuildValue("nn", sent, found);
    return PyLong_FromSsize_t(end - begin);
}

/* same_items(a, b) -> whether lists/tuples a and b hold the very same
 * objects in the same order. */
static PyObject *py_same_items(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("same_items", nargs, 2))
        return NULL;
    Py_ssize_t n = 0, m = 0;
    PyObject **x, **y;
    if (!sequence_items(args[0], &x, &n) || !sequence_items(args[1], &y, &m) || n != m)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; ++i)
        if (x[i] != y[i])
            Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* first_readonly(items) -> the index of the first numpy array of the list
 * or tuple `items` that is not writeable, or -1. */
static PyObject *py_first_readonly(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("first_readonly", nargs, 1))
        return NULL;
    Py_ssize_t n;
    PyObject **x;
    if (!sequence_items(args[0], &x, &n))
        return PyLong_FromLong(-2);
    for (Py_ssize_t i = 0; i < n; ++i)
        if (PyArray_Check(x[i]) && !PyArray_ISWRITEABLE((PyArrayObject *)x[i]))
            return PyLong_FromSsize_t(i);
    return PyLong_FromLong(-1);
}

typedef struct {
    uintptr_t start, end;
    Py_ssize_t index;
} extent;

static int by_start(const void *a, const void *b)
{
    const extent *x = (const extent *)a, *y = (const extent *)b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* first_overlap(items) -> (i, j), i < j, of two C-contiguous numpy arrays of
 * `items` (a list or tuple of C-contiguous numpy arrays) whose memory meets,
 * or None; -1 when an item is not such an array. Empty arrays hold no memory. */
static PyObject *py_first_overlap(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("first_overlap", nargs, 1))
        return NULL;
    Py_ssize_t n, m = 0;
    PyObject **x;
    if (!sequence_items(args[0], &x, &n))
        return PyLong_FromLong(-1);
    extent *e = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(extent));
    if (e == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyArray_Check(x[i]) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)x[i])) {
            PyMem_Free(e);
            return PyLong_FromLong(-1);
        }
        PyArrayObject *a = (PyArrayObject *)x[i];
        Py_ssize_t bytes = PyArray_NBYTES(a);
        if (bytes <= 0)
            continue;
        e[m].start = (uintptr_t)PyArray_DATA(a);
        e[m].end = e[m].start + (uintptr_t)bytes;
        e[m].index = i;
        ++m;
    }
    qsort(e, (size_t)m, sizeof(extent), by_start);
    Py_ssize_t furthest = 0;
    for (Py_ssize_t k = 1; k < m; ++k) {
        if (e[k].start < e[furthest].end) {
            Py_ssize_t i = e[furthest].index, j = e[k].index;
            PyMem_Free(e);
            return Py_BuildValue("(nn)", i < j ? i : j, i < j ? j : i);
        }
        if (e[k].end > e[furthest].end)
            furthest = k;
    }
    PyMem_Free(e);
    Py_RETURN_NONE;
}

/* The memory of a 1-D array of at least `words` 8-byte elements that waits
 * may spin on (an int64 array: exact ndarray, C-contiguous, writeable,
 * 8-byte aligned); else NULL. */
static volatile int64_t *word_array(PyObject *o, Py_ssize_t words)
{
    if (!plain_array(o, 1))
        return NULL;
    PyArrayObject *a = (PyArrayObject *)o;
    if (((uintptr_t)PyArray_DATA(a) & 7) || PyArray_NDIM(a) != 1
            || PyArray_STRIDES(a)[0] != (Py_ssize_t)sizeof(int64_t) || PyArray_DIMS(a)[0] < words)
        return NULL;
    return (volatile int64_t *)PyArray_DATA(a);
}

/* CLOCK_MONOTONIC seconds at which a wait returns to Python: `slice`
 * seconds from now, or `deadline` (a float, or None) if sooner. */
static double wait_until(PyObject *deadline, double slice)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double until = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + slice;
    if (deadline != Py_None) {
        double d = PyFloat_AsDouble(deadline);
        until = d < until ? d : until;
    }
    return until;
}

/* Python's view of a wait's status: -1 once the time slice (or the
 * deadline) passed, -2 - r when rank r left, `done` when every rank arrived. */
static PyObject *wait_status(int status, long done)
{
    if (status == COMMLIB_WAIT_DONE)
        return PyLong_FromLong(done);
    if (status == COMMLIB_WAIT_LATER)
        return PyLong_FromLong(-1);
    return PyLong_FromLong(-2 - status);
}

/* wait_flags(flags, rank, nranks, stride, seq, first, deadline, slice, gone,
 * gone_stride, board_seq) -> 0 once every rank reached `seq` (on the
 * `first` slice of a wait this rank's `seq` is published first); -1 when
 * `slice` seconds (or the deadline, time.monotonic() seconds or None)
 * passed first; -2 - r when rank r left (0 < gone[r * gone_stride] <=
 * board_seq; `gone` an int64 array or None). `flags`: int64 array of at
 * least (nranks - 1) * stride + 1 elements. The GIL is released while
 * waiting. See flag_wait.c. */
static PyObject *py_wait_flags(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("wait_flags", nargs, 11))
        return NULL;
    long rank = PyLong_AsLong(args[1]), nranks = PyLong_AsLong(args[2]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[3]), gone_stride = PyLong_AsSsize_t(args[9]);
    long long seq = PyLong_AsLongLong(args[4]), board_seq = PyLong_AsLongLong(args[10]);
    int first = PyObject_IsTrue(args[5]);
    double until = wait_until(args[6], PyFloat_AsDouble(args[7]));
    if (PyErr_Occurred())
        return NULL;
    if (stride < 1 || nranks < 1 || rank < 0 || rank >= nranks || gone_stride < 1)
        return PyErr_Format(PyExc_ValueError, "commlib: wait_flags got bad ranks or strides");
    volatile int64_t *flags = word_array(args[0], (nranks - 1) * stride + 1);
    volatile int64_t *gone = args[8] == Py_None ? NULL
                             : word_array(args[8], (nranks - 1) * gone_stride + 1);
    if (flags == NULL || (args[8] != Py_None && gone == NULL))
        return PyErr_Format(PyExc_ValueError, "commlib: wait_flags got an unusable flag array");
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = commlib_wait_flags(flags, (int)rank, (int)nranks, stride, seq, first, until, gone,
                                gone_stride, board_seq);
    Py_END_ALLOW_THREADS
    return wait_status(status, 0);
}

/* board_enter(words, stride, nranks, rank, entered_at, gone_at, slot_at, seq,
 * d0, d1, what, when, publishing, deadline, slice) -> 0 once every rank
 * entered collective `seq` with the fingerprint (d0, d1), 1 when a
 * fingerprint differs, -1 when `slice` seconds (or the deadline) passed
 * first, -2 - r when rank r left. `words`: the board, an int64 array of
 * nranks * stride elements; *_at: word offsets in a rank's line (see
 * commlib/faults/board.py); the slot is (d0, d1, what, when). The GIL is released
 * while waiting. */
static PyObject *py_board_enter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("board_enter", nargs, 15))
        return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    long nranks = PyLong_AsLong(args[2]), rank = PyLong_AsLong(args[3]);
    Py_ssize_t at[COMMLIB_BOARD_AT_COUNT];
    for (int i = 0; i < COMMLIB_BOARD_AT_COUNT; ++i)
        at[i] = PyLong_AsSsize_t(args[4 + i]);
    long long seq = PyLong_AsLongLong(args[7]);
    int64_t slot[COMMLIB_BOARD_SLOT_WORDS];
    for (int i = 0; i < COMMLIB_BOARD_SLOT_WORDS; ++i)
        slot[i] = PyLong_AsLongLong(args[8 + i]);
    int publishing = PyObject_IsTrue(args[12]);
    double until = wait_until(args[13], PyFloat_AsDouble(args[14]));
    if (PyErr_Occurred())
        return NULL;
    int ok = stride > 0 && nranks >= 1 && rank >= 0 && rank < nranks;
    for (int i = 0; i < COMMLIB_BOARD_AT_COUNT; ++i)
        ok &= at[i] >= 0 && at[i] + (i == COMMLIB_BOARD_SLOT ? 2 * COMMLIB_BOARD_SLOT_WORDS : 1)
                            <= stride;
    volatile int64_t *words = ok ? word_array(args[0], nranks * stride) : NULL;
    if (words == NULL)
        return PyErr_Format(PyExc_ValueError, "commlib: board_enter got an unusable board");
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = commlib_board_enter(words, stride, (int)nranks, (int)rank, at, seq, slot, publishing,
                                 until);
    Py_END_ALLOW_THREADS
    return wait_status(status == COMMLIB_BOARD_DIFFER ? COMMLIB_WAIT_DONE : status,
                       status == COMMLIB_BOARD_DIFFER);
}

/* The data of `o` when it is a plain array (arrays.h) of numpy type `type`,
 * aligned and in native byte order, with its element count in *size; else
 * NULL. */
static void *typed_data(PyObject *o, int type, int writing, Py_ssize_t *size)
{
    if (!plain_array(o, writing))
        return NULL;
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != type || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a))
        return NULL;
    *size = PyArray_SIZE(a);
    return PyArray_DATA(a);
}

/* The cast format of a plain, aligned, native array: float32, float16 or
 * uint16 (bfloat16 bits); else -1. */
static int cast_format(PyObject *o, int writing, void **data, Py_ssize_t *size)
{
    static const int types[] = {NPY_FLOAT32, NPY_FLOAT16, NPY_UINT16};
    for (int f = 0; f < 3; ++f)
        if ((*data = typed_data(o, types[f], writing, size)) != NULL)
            return f;
    return -1;
}

/* cast(x, out, scale, op[, streaming]) -> the number of non-finite values written, or
 * -1 (nothing written) when x or out is not a plain aligned native array of
 * float32, float16 or uint16 (bfloat16), their sizes differ, or they
 * overlap other than as the same array. `scale`: float or None (no
 * multiply); `op`: 0 none, 1 sum, 2 prod, 3 max, 4 min (see hostcast.c);
 * `streaming` (default false): non-temporal stores where they apply.
 * The GIL is released while casting. */
static PyObject *py_cast(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && check_nargs("cast", nargs, 4))
        return NULL;
    int streaming = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (streaming < 0)
        return NULL;
    int scaled = args[2] != Py_None;
    double scale = scaled ? PyFloat_AsDouble(args[2]) : 1.0;
    long op = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    void *src, *dst;
    Py_ssize_t n = 0, m = 0;
    int sfmt = cast_format(args[0], 0, &src, &n), dfmt = cast_format(args[1], 1, &dst, &m);
    if (sfmt < 0 || dfmt < 0 || n != m || op < CAST_OP_NONE || op > CAST_OP_MIN)
        return PyLong_FromLong(-1);
    const char *s = src, *d = dst;
    Py_ssize_t sbytes = n * PyArray_ITEMSIZE((PyArrayObject *)args[0]);
    Py_ssize_t dbytes = n * PyArray_ITEMSIZE((PyArrayObject *)args[1]);
    if (s < d + dbytes && d < s + sbytes && !(s == d && sfmt == dfmt))
        return PyLong_FromLong(-1);
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = commlib_cast(src, sfmt, dst, dfmt, n, (float)scale, scaled, (int)op, streaming);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(count);
}

/* count_nonfinite(a) -> the number of inf and NaN in `a` (a plain aligned
 * native array of float32, float16 or uint16 as bfloat16), or -1 when it
 * is not one. */
static PyObject *py_count_nonfinite(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("count_nonfinite", nargs, 1))
        return NULL;
    void *data;
    Py_ssize_t n = 0;
    int fmt = cast_format(args[0], 0, &data, &n);
    if (fmt < 0)
        return PyLong_FromLong(-1);
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = commlib_count_nonfinite(data, fmt, n);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(count);
}

/* cast_level(level) -> the cast code path in use (0 portable, 1 AVX2 and
 * F16C); level >= 0 chooses the best this CPU runs up to it, -1 asks. */
static PyObject *py_cast_level(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("cast_level", nargs, 1))
        return NULL;
    long level = PyLong_AsLong(args[0]);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(commlib_cast_level(level < 0 ? -1 : (int)level));
}

/* topk(x, residual, k, indices, values) -> entries selected, or -1 (nothing
 * written) when an array does not qualify: x (and residual, or None)
 * float32 of one size n < 2**31, indices int32 and values float32 of
 * min(k, n) entries, writeable, no residual aliasing x. See hostselect.c. */
static PyObject *py_topk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("topk", nargs, 5))
        return NULL;
    Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = 0, rn = 0, ni = 0, nv = 0;
    float *x = typed_data(args[0], NPY_FLOAT32, 0, &n);
    float *residual = args[1] == Py_None ? NULL : typed_data(args[1], NPY_FLOAT32, 1, &rn);
    int32_t *indices = typed_data(args[3], NPY_INT32, 1, &ni);
    float *values = typed_data(args[4], NPY_FLOAT32, 1, &nv);
    Py_ssize_t kk = k < n ? k : n;
    if (x == NULL || indices == NULL || values == NULL || k < 0 || n > INT32_MAX
            || (args[1] != Py_None && (residual == NULL || rn != n || residual == x))
            || ni != kk || nv != kk)
        return PyLong_FromLong(-1);
    Py_ssize_t s;
    Py_BEGIN_ALLOW_THREADS
    s = commlib_topk(x, residual, n, kk, indices, values);
    Py_END_ALLOW_THREADS
    return s < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(s);
}

/* topk_accumulate(residual, x, acc, k, indices, values) -> the non-finite
 * sums set to 0 in acc, or -1 (nothing written) when an array does not
 * qualify: residual (or None), x and acc float32 of one size n < 2**31, acc
 * writeable and neither of the others, indices int32 and values float32 of
 * min(k, n) entries, writeable. acc = residual + x (non-finite sums 0),
 * then its top-k as topk(acc). See hostselect.c. */
static PyObject *py_topk_accumulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("topk_accumulate", nargs, 6))
        return NULL;
    Py_ssize_t k = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = 0, rn = 0, an = 0, ni = 0, nv = 0;
    float *residual = args[0] == Py_None ? NULL : typed_data(args[0], NPY_FLOAT32, 0, &rn);
    float *x = typed_data(args[1], NPY_FLOAT32, 0, &n);
    float *acc = typed_data(args[2], NPY_FLOAT32, 1, &an);
    int32_t *indices = typed_data(args[4], NPY_INT32, 1, &ni);
    float *values = typed_data(args[5], NPY_FLOAT32, 1, &nv);
    Py_ssize_t kk = k < n ? k : n;
    if (x == NULL || acc == NULL || indices == NULL || values == NULL || k < 0
            || n > INT32_MAX || an != n || acc == x || acc == residual || ni != kk || nv != kk
            || (args[0] != Py_None && (residual == NULL || rn != n)))
        return PyLong_FromLong(-1);
    Py_ssize_t s, nonfinite;
    Py_BEGIN_ALLOW_THREADS
    s = commlib_topk_accumulate(residual, x, acc, n, kk, indices, values, &nonfinite);
    Py_END_ALLOW_THREADS
    return s < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(nonfinite);
}

/* threshold(residual, x, acc, tkey, indices, values) -> (entries
 * qualifying, non-finite sums), or -1 (nothing written) when an array does
 * not qualify: x float32 of n < 2**31 entries, indices int32 and values
 * float32 of one capacity, writeable; acc None (select from x) or float32
 * of n, writeable, neither x nor residual, which is None or float32 of n.
 * With acc: acc = residual + x (non-finite sums 0) and the selection is
 * acc's. */
static PyObject *py_threshold(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("threshold", nargs, 6))
        return NULL;
    long long tkey = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = 0, rn = 0, an = 0, ni = 0, nv = 0;
    float *residual = args[0] == Py_None ? NULL : typed_data(args[0], NPY_FLOAT32, 0, &rn);
    float *x = typed_data(args[1], NPY_FLOAT32, 0, &n);
    float *acc = args[2] == Py_None ? NULL : typed_data(args[2], NPY_FLOAT32, 1, &an);
    int32_t *indices = typed_data(args[4], NPY_INT32, 1, &ni);
    float *values = typed_data(args[5], NPY_FLOAT32, 1, &nv);
    if (x == NULL || indices == NULL || values == NULL || ni != nv || n > INT32_MAX
            || tkey < 0 || tkey > 0x7F800000LL
            || (args[2] != Py_None && (acc == NULL || an != n || acc == x || acc == residual))
            || (args[0] != Py_None && (args[2] == Py_None || residual == NULL || rn != n)))
        return PyLong_FromLong(-1);
    Py_ssize_t c, nonfinite = 0;
    Py_BEGIN_ALLOW_THREADS
    c = acc == NULL ? commlib_threshold(x, n, (uint32_t)tkey, indices, values, ni)
                    : commlib_threshold_accumulate(residual, x, acc, n, (uint32_t)tkey, indices,
                                                   values, ni, &nonfinite);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("nn", c, nonfinite);
}

/* The (dense, indices, values) of a scatter: dense float32 writeable,
 * indices int32 and values float32 of one length m, all plain aligned
 * native arrays; 0, or -1 when they do not qualify. */
static int scatter_arrays(PyObject *const *args, float **dense, Py_ssize_t *n,
                          int32_t **indices, float **values, Py_ssize_t *m)
{
    Py_ssize_t nv = 0;
    *n = *m = 0;
    *dense = typed_data(args[0], NPY_FLOAT32, 1, n);
    *indices = typed_data(args[1], NPY_INT32, 0, m);
    *values = typed_data(args[2], NPY_FLOAT32, 0, &nv);
    return *dense == NULL || *indices == NULL || *values == NULL || *m != nv || *n > INT32_MAX
           ? -1 : 0;
}

/* scatter(dense, indices, values, factor, summing) -> out-of-range indices
 * skipped, or -1 (nothing written) when the arrays do not qualify (see
 * scatter_arrays). Not `summing`: dense[indices[i]] += factor * values[i]
 * (factor a float). `summing`: dense becomes the sum of the entries, times
 * `factor` (a float, or None for none). See hostselect.c. */
static PyObject *py_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("scatter", nargs, 5))
        return NULL;
    int scaled = args[3] != Py_None, summing = PyObject_IsTrue(args[4]);
    double factor = scaled ? PyFloat_AsDouble(args[3]) : 1.0;
    if (PyErr_Occurred())
        return NULL;
    float *dense, *values;
    int32_t *indices;
    Py_ssize_t n, m, bad;
    if ((!summing && !scaled) || scatter_arrays(args, &dense, &n, &indices, &values, &m))
        return PyLong_FromLong(-1);
    Py_BEGIN_ALLOW_THREADS
    bad = summing ? commlib_sparse_sum(dense, n, indices, values, m, (float)factor, scaled)
                  : commlib_scatter_add(dense, n, indices, values, m, (float)factor);
    Py_END_ALLOW_THREADS
    return bad < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(bad);
}

/* accumulate_finite(residual, x, acc) -> non-finite entries set to 0, or -1
 * (nothing written) when an array does not qualify (float32 of one size;
 * residual may be None; acc writeable and neither of the others). */
static PyObject *py_accumulate_finite(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("accumulate_finite", nargs, 3))
        return NULL;
    Py_ssize_t n = 0, rn = 0, an = 0;
    float *residual = args[0] == Py_None ? NULL : typed_data(args[0], NPY_FLOAT32, 0, &rn);
    float *x = typed_data(args[1], NPY_FLOAT32, 0, &n);
    float *acc = typed_data(args[2], NPY_FLOAT32, 1, &an);
    if (x == NULL || acc == NULL || an != n || acc == x || acc == residual
            || (args[0] != Py_None && (residual == NULL || rn != n)))
        return PyLong_FromLong(-1);
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = commlib_accumulate_finite(residual, x, acc, n);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))py_init, METH_FASTCALL, NULL},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, NULL},
    {"reduce_share", (PyCFunction)(void (*)(void))py_reduce_share, METH_FASTCALL, NULL},
    {"same_items", (PyCFunction)(void (*)(void))py_same_items, METH_FASTCALL, NULL},
    {"first_readonly", (PyCFunction)(void (*)(void))py_first_readonly, METH_FASTCALL, NULL},
    {"first_overlap", (PyCFunction)(void (*)(void))py_first_overlap, METH_FASTCALL, NULL},
    {"wait_flags", (PyCFunction)(void (*)(void))py_wait_flags, METH_FASTCALL, NULL},
    {"board_enter", (PyCFunction)(void (*)(void))py_board_enter, METH_FASTCALL, NULL},
    {"cast", (PyCFunction)(void (*)(void))py_cast, METH_FASTCALL, NULL},
    {"count_nonfinite", (PyCFunction)(void (*)(void))py_count_nonfinite, METH_FASTCALL, NULL},
    {"cast_level", (PyCFunction)(void (*)(void))py_cast_level, METH_FASTCALL, NULL},
    {"topk", (PyCFunction)(void (*)(void))py_topk, METH_FASTCALL, NULL},
    {"topk_accumulate", (PyCFunction)(void (*)(void))py_topk_accumulate, METH_FASTCALL, NULL},
    {"threshold", (PyCFunction)(void (*)(void))py_threshold, METH_FASTCALL, NULL},
    {"scatter", (PyCFunction)(void (*)(void))py_scatter, METH_FASTCALL, NULL},
    {"accumulate_finite", (PyCFunction)(void (*)(void))py_accumulate_finite, METH_FASTCALL,
     NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "commlib._hostloops", "commlib's compiled host loops", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostloops(void)
{
    import_array();
    return PyModule_Create(&definition);
}
