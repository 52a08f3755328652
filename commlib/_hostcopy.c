/* Batched host copies between many numpy arrays and one flat buffer.
 *
 * Compiled on first use by commlib/ops/hostcopy.py and called through
 * ctypes.PyDLL (the GIL is held). Each array's data pointer, shape and flags
 * are read from the array object at the time of the call, so a copy never
 * uses a stale address. The head of a numpy array object (data, nd,
 * dimensions, strides, base, descr, flags) has had this layout in every
 * numpy release, 1.x and 2.x.
 */
#include <Python.h>
#include <string.h>

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

#define C_CONTIGUOUS 0x0001
#define WRITEABLE 0x0400

static Py_ssize_t array_bytes(const array_head *a, Py_ssize_t itemsize)
{
    Py_ssize_t bytes = itemsize;
    for (int d = 0; d < a->nd; ++d)
        bytes *= a->dimensions[d];
    return bytes;
}

/* Bytes of every array in `arrays` (a tuple or list), back to back, or -1
 * when one is not an exact `ndarray` of dtype object `descr`, C-contiguous
 * (and writeable when `writing`), or the total exceeds `capacity`. */
static Py_ssize_t checked_total(PyObject *arrays, PyObject *ndarray, PyObject *descr,
                                Py_ssize_t itemsize, Py_ssize_t capacity, int writing)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arrays);
    PyObject **items = PySequence_Fast_ITEMS(arrays);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        array_head *a = (array_head *)items[i];
        if ((PyObject *)Py_TYPE(items[i]) != ndarray || a->descr != descr)
            return -1;
        if (!(a->flags & C_CONTIGUOUS) || (writing && !(a->flags & WRITEABLE)))
            return -1;
        Py_ssize_t bytes = array_bytes(a, itemsize);
        if (bytes < 0 || bytes > capacity - total)
            return -1;
        total += bytes;
    }
    return total;
}

/* Copy between every array of `arrays` and the flat buffer `flat` (capacity
 * bytes), back to back: into the buffer when `to_arrays` is 0 (gather), out
 * of it into the arrays otherwise (scatter). Returns the bytes copied, or -1
 * with nothing copied. */
Py_ssize_t commlib_copy(PyObject *arrays, PyObject *ndarray, PyObject *descr,
                        Py_ssize_t itemsize, char *flat, Py_ssize_t capacity, int to_arrays)
{
    if (!PyTuple_Check(arrays) && !PyList_Check(arrays))
        return -1;
    Py_ssize_t total = checked_total(arrays, ndarray, descr, itemsize, capacity, to_arrays);
    if (total < 0)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arrays);
    PyObject **items = PySequence_Fast_ITEMS(arrays);
    for (Py_ssize_t i = 0; i < n; ++i) {
        array_head *a = (array_head *)items[i];
        Py_ssize_t bytes = array_bytes(a, itemsize);
        if (to_arrays)
            memcpy(a->data, flat, (size_t)bytes);
        else
            memcpy(flat, a->data, (size_t)bytes);
        flat += bytes;
    }
    return total;
}
