/* What the compiled host loops share: numpy's C API and the checks every
 * entry point runs before touching memory.
 *
 * module.c checks the arrays and reads each one's data pointer and size
 * (a span) with the GIL held, at the time of the call, so a loop never uses
 * a stale address; the loops over spans then run without the GIL (the
 * caller's references keep the arrays alive). module.c imports numpy's C
 * API; the other files use it through the same table. */
#ifndef COMMLIB_ARRAYS_H
#define COMMLIB_ARRAYS_H

#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL commlib_hostloops_ARRAY_API
#ifndef COMMLIB_IMPORTS_NUMPY
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

/* The memory of array `a`, as bytes. */
static inline char *array_data(PyObject *a)
{
    return (char *)PyArray_DATA((PyArrayObject *)a);
}

/* Bytes of `a` counted in units of `itemsize` (its element count times it). */
static inline Py_ssize_t array_bytes(PyObject *a, Py_ssize_t itemsize)
{
    return itemsize * (Py_ssize_t)PyArray_SIZE((PyArrayObject *)a);
}

/* Whether `o` is an exact numpy.ndarray, C-contiguous, and writeable when
 * `writing`. */
static inline int plain_array(PyObject *o, int writing)
{
    if (!PyArray_CheckExact(o))
        return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    return PyArray_IS_C_CONTIGUOUS(a) && (!writing || PyArray_ISWRITEABLE(a));
}

/* Bytes of every array in `arrays` (a tuple or list), back to back, or -1
 * when `arrays` is not a tuple or list, or one item is not a plain array
 * (see plain_array) of dtype object `descr`, or the total exceeds
 * `capacity`. */
static inline Py_ssize_t checked_total(PyObject *arrays, PyArray_Descr *descr,
                                       Py_ssize_t itemsize, Py_ssize_t capacity, int writing)
{
    if (!PyTuple_Check(arrays) && !PyList_Check(arrays))
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arrays);
    PyObject **items = PySequence_Fast_ITEMS(arrays);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!plain_array(items[i], writing) || PyArray_DESCR((PyArrayObject *)items[i]) != descr)
            return -1;
        Py_ssize_t bytes = array_bytes(items[i], itemsize);
        if (bytes < 0 || bytes > capacity - total)
            return -1;
        total += bytes;
    }
    return total;
}

/* The memory of one array: its data and its size in bytes. */
typedef struct {
    char *data;
    Py_ssize_t bytes;
} commlib_span;

/* The spans of the arrays in `arrays` (a tuple or list already checked with
 * checked_total), into `stack` when they fit in `stack_len`, else into new
 * memory the caller frees with PyMem_Free when it differs from `stack`;
 * NULL (with MemoryError set) when that fails. `*n` is set to their number. */
static inline commlib_span *spans_of(PyObject *arrays, Py_ssize_t itemsize, commlib_span *stack,
                                     Py_ssize_t stack_len, Py_ssize_t *n)
{
    *n = PySequence_Fast_GET_SIZE(arrays);
    PyObject **items = PySequence_Fast_ITEMS(arrays);
    commlib_span *spans = *n <= stack_len ? stack
                                          : PyMem_Malloc((size_t)*n * sizeof(commlib_span));
    if (spans == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; ++i) {
        spans[i].data = array_data(items[i]);
        spans[i].bytes = array_bytes(items[i], itemsize);
    }
    return spans;
}

/* Spans kept on the stack before spans_of allocates. */
#define COMMLIB_STACK_SPANS 64

#endif
