/* Waits on sequence numbers in shared memory, spun on without the GIL: the
 * shared-memory reducer's synchronisation (commlib/transport/shm.py) and
 * the status board's entry into a collective (commlib/faults/board.py).
 *
 * Every wait gives up early when a rank it waits for has left (its "gone"
 * word on the status board is positive and at most the collective's
 * sequence number)
 * and returns to Python once `until` has passed, so that Python can run
 * signal handlers, check deadlines and look for dead processes. */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "native.h"

/* Polls of a peer's word before each further poll also yields the CPU. */
#define SPINS 20000

static double monotonic_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);    /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int commlib_wait_all(const volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                     int64_t target, const volatile int64_t *gone, Py_ssize_t gone_stride,
                     int64_t seq, double until)
{
    for (int r = 0; r < nranks; ++r) {
        long polls = 0;
        while (r != rank && __atomic_load_n(&words[r * stride], __ATOMIC_ACQUIRE) < target) {
            if (gone != NULL) {
                int64_t left = __atomic_load_n(&gone[r * gone_stride], __ATOMIC_ACQUIRE);
                if (left > 0 && left <= seq)
                    return COMMLIB_WAIT_GONE(r);
            }
            if (++polls > SPINS) {
                sched_yield();
                if (monotonic_seconds() >= until)
                    return COMMLIB_WAIT_LATER;
            }
        }
    }
    return COMMLIB_WAIT_DONE;
}

int commlib_wait_flags(volatile int64_t *flags, int rank, int nranks, Py_ssize_t stride,
                       int64_t seq, int first, double until, const volatile int64_t *gone,
                       Py_ssize_t gone_stride, int64_t board_seq)
{
    if (first)
        __atomic_store_n(&flags[rank * stride], seq, __ATOMIC_RELEASE);
    return commlib_wait_all(flags, stride, nranks, rank, seq, gone, gone_stride, board_seq,
                            until);
}

int commlib_board_enter(volatile int64_t *words, Py_ssize_t stride, int nranks, int rank,
                        const Py_ssize_t *at, int64_t seq, const int64_t *slot, int publishing,
                        double until)
{
    volatile int64_t *mine = words + rank * stride;
    Py_ssize_t parity = at[COMMLIB_BOARD_SLOT] + (seq & 1) * COMMLIB_BOARD_SLOT_WORDS;
    if (publishing) {
        for (int i = 0; i < COMMLIB_BOARD_SLOT_WORDS; ++i)
            __atomic_store_n(&mine[parity + i], slot[i], __ATOMIC_RELAXED);
        __atomic_store_n(&mine[at[COMMLIB_BOARD_ENTERED]], seq, __ATOMIC_RELEASE);
    }
    const volatile int64_t *gone = words + at[COMMLIB_BOARD_GONE];
    int status = commlib_wait_all(words + at[COMMLIB_BOARD_ENTERED], stride, nranks, rank, seq,
                                  gone, stride, seq, until);
    if (status != COMMLIB_WAIT_DONE)
        return status;
    /* a rank that entered and then gave up on this collective will never
     * take part in its exchange */
    for (int r = 0; r < nranks; ++r) {
        int64_t left = __atomic_load_n(&gone[r * stride], __ATOMIC_ACQUIRE);
        if (r != rank && left > 0 && left <= seq)
            return COMMLIB_WAIT_GONE(r);
    }
    /* every rank wrote its fingerprint (words 0 and 1 of its slot) before
     * its sequence number; nobody writes this parity's slot again before
     * every rank has entered the next collective */
    for (int r = 0; r < nranks; ++r)
        for (int i = 0; i < 2; ++i)
            if (words[r * stride + parity + i] != slot[i])
                return COMMLIB_BOARD_DIFFER;
    return COMMLIB_WAIT_DONE;
}
