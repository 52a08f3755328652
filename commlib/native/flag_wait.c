/* The shared-memory reducer's synchronisation (commlib/transport/shm.py):
 * one sequence number per rank, spun on without the GIL. */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "native.h"

/* Polls of a peer's flag before each further poll also yields the CPU. */
#define SPINS 20000

static double monotonic_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);    /* the clock of Python's time.monotonic() */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* `flags` holds, per rank r, a sequence number at r * stride and a published
 * value at r * stride + 1. Store `publish` (when `publishing`) and then
 * `seq` as this rank's, with release order after every earlier store, and
 * wait until every rank's sequence number is at least `seq`. `deadline`:
 * seconds on CLOCK_MONOTONIC, or negative for none. Returns 0, or -1 once
 * the deadline has passed. On 0, *published_max is the largest value every
 * rank has published, or 0 if some rank's is 0 or less. */
int commlib_wait_flags(volatile int64_t *flags, int rank, int nranks, Py_ssize_t stride,
                       int64_t seq, int64_t publish, int publishing, double deadline,
                       int64_t *published_max)
{
    if (publishing)
        __atomic_store_n(&flags[rank * stride + 1], publish, __ATOMIC_RELAXED);
    __atomic_store_n(&flags[rank * stride], seq, __ATOMIC_RELEASE);
    for (int r = 0; r < nranks; ++r) {
        long polls = 0;
        while (r != rank && __atomic_load_n(&flags[r * stride], __ATOMIC_ACQUIRE) < seq) {
            if (++polls > SPINS) {
                sched_yield();
                if (deadline >= 0 && monotonic_seconds() >= deadline)
                    return -1;
            }
        }
    }
    int64_t most = 0;
    for (int r = 0; r < nranks; ++r) {
        int64_t value = __atomic_load_n(&flags[r * stride + 1], __ATOMIC_RELAXED);
        if (value <= 0) {
            most = 0;
            break;
        }
        most = value > most ? value : most;
    }
    *published_max = most;
    return 0;
}
