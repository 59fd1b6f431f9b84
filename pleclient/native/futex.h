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

/* A word no one can wake a futex on (a GPU stream writes it): looked at,
 * not slept on. */
typedef struct {
    const _Atomic uint32_t *word;
    uint32_t idle;
} ple_polled_word;

/* ple_futex_waitv on entries while every polled word holds its idle value,
 * the polled words looked at before each sleep and every poll_ns (> 0): a
 * poll without a return to the caller costs one system call. The index of
 * the entry woken (< n), n + j where polled word j differs from its idle
 * value, or -EAGAIN, -ETIMEDOUT (timeout_ns passed; < 0: no limit), -EINTR,
 * -ENOSYS, -EINVAL as ple_futex_waitv. Each polled word is read with an
 * acquire load (E2): a peek; its reader takes the word itself after. */
int ple_futex_waitv_polling(const ple_futex_wait_entry *entries, size_t n,
                            const ple_polled_word *polled, size_t m, int64_t poll_ns,
                            int64_t timeout_ns);

/* Whether this kernel offers futex_waitv (probed once, cached). */
int ple_futex_waitv_available(void);

#endif
