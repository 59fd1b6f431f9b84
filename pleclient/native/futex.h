/* Raw futex system calls on 32-bit words that may be shared between
 * processes (no FUTEX_PRIVATE_FLAG anywhere: the channel's words live in a
 * memfd that two processes map). Thin wrappers: errors come back as -errno,
 * never through errno, so callers can release the GIL around them freely. */
#ifndef PLECLIENT_FUTEX_H
#define PLECLIENT_FUTEX_H

#include <stddef.h>
#include <stdint.h>

/* One word of a futex_waitv call: wait while *word == expected. */
typedef struct {
    const uint32_t *word;
    uint32_t expected;
} ple_futex_wait_entry;

#define PLE_FUTEX_WAITV_MAX 128 /* the kernel's FUTEX_WAITV_MAX */

/* Sleep while *word == expected, at most timeout_ns (< 0: no limit).
 * 0 on a wake-up, -EAGAIN if *word != expected already, -ETIMEDOUT, -EINTR. */
int ple_futex_wait(const uint32_t *word, uint32_t expected, int64_t timeout_ns);

/* Wake up to n sleepers on word; the number woken, or -errno. */
int ple_futex_wake(const uint32_t *word, int n);

/* Sleep until any entry's word differs from its expected value, or one is
 * woken, at most timeout_ns (< 0: no limit). The index woken (≥ 0), or
 * -EAGAIN (a word differed already), -ETIMEDOUT, -EINTR, -ENOSYS (kernel
 * older than 5.16, or the call refused by a seccomp filter), -EINVAL. */
int ple_futex_waitv(const ple_futex_wait_entry *entries, size_t n, int64_t timeout_ns);

/* Whether this kernel offers futex_waitv (probed once, cached). */
int ple_futex_waitv_available(void);

#endif
