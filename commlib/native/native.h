/* The compiled host loops (one extension module, commlib/ops/_native.py).
 * Each function trusts its arguments: module.c checks them. */
#ifndef COMMLIB_NATIVE_H
#define COMMLIB_NATIVE_H

#include "array_head.h"

/* hostcopy.c */
void commlib_copy(PyObject *arrays, Py_ssize_t itemsize, char *flat, int to_arrays,
                  Py_ssize_t skip_begin, Py_ssize_t skip_end, Py_ssize_t total, int streaming);

/* hostreduce.c */
enum { COMMLIB_T_FLOAT32, COMMLIB_T_FLOAT64, COMMLIB_T_INT32, COMMLIB_T_INT64,
       COMMLIB_T_UINT8, COMMLIB_T_COUNT };
enum { COMMLIB_OP_SUM, COMMLIB_OP_PROD, COMMLIB_OP_MAX, COMMLIB_OP_MIN, COMMLIB_OP_COUNT };
void commlib_reduce_share(PyObject *arrays, Py_ssize_t itemsize, int type, int op,
                          char *const *slots, int nranks, int rank, char *result,
                          Py_ssize_t begin, Py_ssize_t end, double scale, int scaled,
                          int streaming);

/* flag_wait.c */
int commlib_wait_flags(volatile int64_t *flags, int rank, int nranks, Py_ssize_t stride,
                       int64_t seq, int64_t publish, int publishing, double deadline,
                       int64_t *published_max);

#endif
