/* What the compiled host loops share: the head of a numpy array object and
 * the checks every entry point runs before touching memory.
 *
 * The loops run inside the extension module (module.c) with the GIL held.
 * Each array's data pointer, shape and flags are read from the array object
 * at the time of the call, so a loop never uses a stale address. The head of a numpy
 * array object (data, nd, dimensions, strides, base, descr, flags) has had
 * this layout in every numpy release, 1.x and 2.x.
 */
#ifndef COMMLIB_ARRAY_HEAD_H
#define COMMLIB_ARRAY_HEAD_H

#include <Python.h>

typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} array_head;

#define COMMLIB_C_CONTIGUOUS 0x0001
#define COMMLIB_WRITEABLE 0x0400

static inline Py_ssize_t array_bytes(const array_head *a, Py_ssize_t itemsize)
{
    Py_ssize_t bytes = itemsize;
    for (int d = 0; d < a->nd; ++d)
        bytes *= a->dimensions[d];
    return bytes;
}

/* Bytes of every array in `arrays` (a tuple or list), back to back, or -1
 * when `arrays` is not a tuple or list, or one item is not an exact
 * `ndarray` of dtype object `descr`, C-contiguous (and writeable when
 * `writing`), or the total exceeds `capacity`. */
static inline Py_ssize_t checked_total(PyObject *arrays, PyObject *ndarray, PyObject *descr,
                                       Py_ssize_t itemsize, Py_ssize_t capacity, int writing)
{
    if (!PyTuple_Check(arrays) && !PyList_Check(arrays))
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arrays);
    PyObject **items = PySequence_Fast_ITEMS(arrays);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        array_head *a = (array_head *)items[i];
        if ((PyObject *)Py_TYPE(items[i]) != ndarray || a->descr != descr)
            return -1;
        if (!(a->flags & COMMLIB_C_CONTIGUOUS) || (writing && !(a->flags & COMMLIB_WRITEABLE)))
            return -1;
        Py_ssize_t bytes = array_bytes(a, itemsize);
        if (bytes < 0 || bytes > capacity - total)
            return -1;
        total += bytes;
    }
    return total;
}

#endif
