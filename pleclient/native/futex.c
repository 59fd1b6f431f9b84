/* Raw futex system calls (see futex.h).
 *
 * Which calls, on every architecture Linux has (x86-64 and aarch64 alike):
 * - futex(FUTEX_WAIT) with a relative CLOCK_MONOTONIC timeout, and
 *   futex(FUTEX_WAKE); the kernel reads the word under its hash-bucket lock
 *   after a full barrier, so a wake that follows a store of a new value can
 *   never be lost between the caller's check and its sleep;
 * - futex_waitv (Linux 5.16+), system call 449 on every architecture (it was
 *   added after the numbers were unified), with FUTEX2_SIZE_U32 entries and
 *   an absolute CLOCK_MONOTONIC deadline. */
#include "futex.h"

#include <errno.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif
#ifndef FUTEX2_SIZE_U32
#define FUTEX2_SIZE_U32 0x02
#endif

/* The kernel's struct futex_waitv (uapi/linux/futex.h, 5.16+), spelt out so
 * that older headers build too. */
struct ple_kernel_waitv {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};

static struct timespec ns_to_timespec(int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    return ts;
}

int ple_futex_wait(const uint32_t *word, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts = ns_to_timespec(timeout_ns < 0 ? 0 : timeout_ns);
    long rc = syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout_ns < 0 ? NULL : &ts,
                      NULL, 0);
    return rc == 0 ? 0 : -errno;
}

int ple_futex_wake(const uint32_t *word, int n)
{
    long rc = syscall(SYS_futex, word, FUTEX_WAKE, n, NULL, NULL, 0);
    return rc >= 0 ? (int)rc : -errno;
}

int ple_futex_waitv(const ple_futex_wait_entry *entries, size_t n, int64_t timeout_ns)
{
    if (n == 0 || n > PLE_FUTEX_WAITV_MAX)
        return -EINVAL;
    struct ple_kernel_waitv waitv[PLE_FUTEX_WAITV_MAX] = {{0}};
    for (size_t i = 0; i < n; i++) {
        waitv[i].val = entries[i].expected;
        waitv[i].uaddr = (uint64_t)(uintptr_t)entries[i].word;
        waitv[i].flags = FUTEX2_SIZE_U32; /* shared: no FUTEX2_PRIVATE */
    }
    struct timespec deadline, *dp = NULL;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        int64_t ns = deadline.tv_nsec + timeout_ns % 1000000000;
        deadline.tv_sec += timeout_ns / 1000000000 + ns / 1000000000;
        deadline.tv_nsec = ns % 1000000000;
        dp = &deadline;
    }
    long rc = syscall(SYS_futex_waitv, waitv, (unsigned)n, 0, dp, CLOCK_MONOTONIC);
    return rc >= 0 ? (int)rc : -errno;
}

static int64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

int ple_futex_waitv_polling(const ple_futex_wait_entry *entries, size_t n,
                            const ple_polled_word *polled, size_t m, int64_t poll_ns,
                            int64_t timeout_ns)
{
    if (poll_ns <= 0)
        return -EINVAL;
    int64_t deadline = timeout_ns < 0 ? INT64_MAX : monotonic_ns() + timeout_ns;
    for (;;) {
        for (size_t j = 0; j < m; j++) {
            /* E2: a peek; pairs with the writer's release (a stream's fenced
             * write, G2). The reader's exchange (X1) orders what it reads. */
            if (atomic_load_explicit(polled[j].word, memory_order_acquire) != polled[j].idle)
                return (int)(n + j);
        }
        int64_t left = deadline - monotonic_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        int rc = ple_futex_waitv(entries, n, left < poll_ns ? left : poll_ns);
        if (rc != -ETIMEDOUT)
            return rc; /* woken, a word that differed, a signal, or an error */
    }
}

int ple_futex_waitv_available(void)
{
    /* -1 unknown, 0 no, 1 yes. Relaxed: every thread computes the same answer. */
    static atomic_int available = -1;
    int known = atomic_load_explicit(&available, memory_order_relaxed);
    if (known >= 0)
        return known;
    /* An expected value that differs from the word: the kernel answers EAGAIN
     * at once where the call exists, ENOSYS (or EPERM from seccomp) where not. */
    uint32_t word = 1;
    ple_futex_wait_entry entry = {.word = &word, .expected = 0};
    int rc = ple_futex_waitv(&entry, 1, 0);
    known = rc == -EAGAIN || rc >= 0 || rc == -ETIMEDOUT;
    atomic_store_explicit(&available, known, memory_order_relaxed);
    return known;
}
