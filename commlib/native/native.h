/* The compiled host loops (the extension module commlib._hostloops, loaded
 * by commlib/ops/_native.py).
 * Each function trusts its arguments: module.c checks them. */
#ifndef COMMLIB_NATIVE_H
#define COMMLIB_NATIVE_H

#include "arrays.h"

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

/* flag_wait.c: a wait returns COMMLIB_WAIT_DONE when every rank arrived,
 * COMMLIB_WAIT_LATER once `until` (CLOCK_MONOTONIC seconds) has passed, or
 * the rank r >= 0 that has left (COMMLIB_WAIT_GONE(r)). */
#define COMMLIB_WAIT_DONE (-1)
#define COMMLIB_WAIT_LATER (-2)
#define COMMLIB_BOARD_DIFFER (-3)
#define COMMLIB_WAIT_GONE(r) (r)
/* Indices into the `at` array of commlib_board_enter: word offsets within a
 * rank's line of the sequence number entered, the gone-at sequence number
 * and the first fingerprint slot (two slots of COMMLIB_BOARD_SLOT_WORDS). */
enum { COMMLIB_BOARD_ENTERED, COMMLIB_BOARD_GONE, COMMLIB_BOARD_SLOT, COMMLIB_BOARD_AT_COUNT };
#define COMMLIB_BOARD_SLOT_WORDS 4

/* Wait until words[r * stride] >= target for every rank r != rank; give up
 * when such a rank has 0 < gone[r * gone_stride] <= seq (gone may be NULL). */
int commlib_wait_all(const volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                     int64_t target, const volatile int64_t *gone, Py_ssize_t gone_stride,
                     int64_t seq, double until);

/* The shared-memory reducer's synchronisation: on the `first` slice of a
 * wait publish `seq` at flags[rank * stride] (release order), then wait for
 * every rank's. */
int commlib_wait_flags(volatile int64_t *flags, int rank, int nranks, Py_ssize_t stride,
                       int64_t seq, int first, double until, const volatile int64_t *gone,
                       Py_ssize_t gone_stride, int64_t board_seq);

/* The status board's entry into collective `seq`: publish this rank's
 * fingerprint slot (when `publishing`) and then `seq`, wait for every rank
 * to enter `seq`, and compare the first two words of every rank's slot
 * (COMMLIB_BOARD_DIFFER when they differ). */
int commlib_board_enter(volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                        const Py_ssize_t *at, int64_t seq, const int64_t *slot, int publishing,
                        double until);

#endif
