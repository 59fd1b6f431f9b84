/* The eventcount (see eventcount.h for the words, the promises and the
 * ordering edges E1-E5). */
#include "eventcount.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <time.h>

#include "futex.h"

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int ple_ec_publish(atomic_uint *word, uint32_t value, atomic_uint *waiters)
{
    /* E1: release, pairs with E2: the payload (ids, rows, result words)
     * before the word. */
    atomic_store_explicit(word, value, memory_order_release);
    /* E3: seq_cst fence, pairs with E4 (and E5): the word before the read of
     * the waiters count. At least one side sees the other: the waiter sees
     * the new value, or we see the waiter. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(waiters, memory_order_relaxed) == 0)
        return 0;
    /* Whatever the waiters word says, one wake call per publish: a peer that
     * scribbles on it costs one system call per publish, never a storm. */
    ple_futex_wake((const uint32_t *)word, INT_MAX);
    return 1;
}

int ple_ec_wait_while(atomic_uint *word, uint32_t value, atomic_uint *waiters, int64_t timeout_ns,
                      int64_t spin_ns, uint32_t *seen)
{
    int64_t start = now_ns();
    int64_t spin_end = start + (spin_ns < timeout_ns ? spin_ns : timeout_ns);
    int64_t deadline = start + timeout_ns;
    uint32_t now;
    int err = 0;
    /* Spin, yielding the CPU between loads: on a busy machine the peer may
     * need this very core to answer. E2: acquire, pairs with E1: the payload
     * is visible with the word. */
    while ((now = atomic_load_explicit(word, memory_order_acquire)) == value
           && now_ns() < spin_end)
        sched_yield();
    if (now == value && timeout_ns > 0) {
        /* E4: register (a seq_cst read-modify-write), then the seq_cst fence
         * that pairs with E3, then check once more and sleep. The count may
         * be shared with other threads waiting on the same word. */
        atomic_fetch_add_explicit(waiters, 1, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        for (;;) {
            now = atomic_load_explicit(word, memory_order_acquire); /* E2 */
            int64_t left = deadline - now_ns();
            if (now != value || left <= 0)
                break;
            int rc = ple_futex_wait((const uint32_t *)word, value, left);
            if (rc != 0 && rc != -EAGAIN && rc != -ETIMEDOUT && rc != -EINTR) {
                err = rc;
                break;
            }
        }
        atomic_fetch_sub_explicit(waiters, 1, memory_order_seq_cst);
        now = atomic_load_explicit(word, memory_order_acquire); /* E2 */
    }
    *seen = now;
    return err;
}

void ple_ec_announce(atomic_uint *word, uint32_t value)
{
    /* E5: the store, then a seq_cst fence (pairs with E3), so the caller's
     * next load cannot be satisfied before the peer can see the store. */
    atomic_store_explicit(word, value, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
}

int ple_ec_wake(atomic_uint *word, int n)
{
    return ple_futex_wake((const uint32_t *)word, n);
}
